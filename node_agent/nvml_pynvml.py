"""The real NVML adapter over ``pynvml`` (distribution ``nvidia-ml-py``), calls per facts/mig.md.

Model
-----
A thin translation of :class:`node_agent.nvml.Nvml` into driver calls; no policy lives here.

* GPUs: ``nvmlDeviceGetCount`` / ``GetHandleByIndex`` / ``GetUUID`` / ``GetName`` /
  ``GetPciInfo`` (``pciDeviceId >> 16`` is the device id) / ``GetMemoryInfo`` / ``GetMigMode`` /
  ``GetComputeMode``; ``nvmlDeviceSetComputeMode`` sets it (``NVML_COMPUTEMODE_*``).  With
  ``isolate=True`` an error after ``nvmlDeviceGetCount`` lists that GPU with ``read_error``.
* MIG mode: ``nvmlDeviceGetMigMode`` -> ``[current, pending]`` (both kept: on Ampere a change is
  pending until a GPU reset); ``nvmlDeviceSetMigMode`` returns the activation status, an
  ``nvmlReturn_t``: ``NVML_SUCCESS`` (0) -> ``None`` (active now), anything else -> that
  :class:`~node_agent.nvml.NvmlErrorCode` (e.g. ``RESET_REQUIRED``, ``IN_USE``: pending).
* GPU reset: NVML's public API (and so nvidia-ml-py) has no call that resets a GPU, so
  :meth:`PynvmlAdapter.reset_gpu` runs the host driver's ``nvidia-smi -r -i <busId>`` like
  NVIDIA's mig-parted (:func:`node_agent.gpu_reset.reset_gpu`, persistence mode from
  ``nvmlDeviceGetPersistenceMode`` turned off around it).  NVML is shut down for the reset (an
  NVML client holds the device, as any "monitoring application" would) and initialised again
  afterwards, whatever the outcome; cached handles and profiles are dropped.
* Process names: ``nvmlSystemGetProcessName(pid)`` (``""`` when NVML cannot tell).
* GPU instances are enumerated per profile: for every profile index from 0 up to the larger
  of the binding's ``NVML_GPU_INSTANCE_PROFILE_COUNT`` and the highest ``nvml_index`` of the
  catalog + 1 (an older nvidia-ml-py stops at 0xA, before the RTX PRO ``+gfx`` indices 0xA/0xB
  that the driver answers whatever the binding) the profile info (``NOT_SUPPORTED`` /
  ``INVALID_ARGUMENT`` skipped) gives the profile id and the maximum count, then
  ``nvmlDeviceGetGpuInstances(h, id, array, byref(n))`` and ``nvmlGpuInstanceGetInfo`` give GI
  id and placement.  Its compute instances are listed per compute-instance profile, as NVIDIA's
  go-nvlib visits them: ``nvmlGpuInstanceGetComputeInstanceProfileInfo`` for every index from 0
  up to ``NVML_COMPUTE_INSTANCE_PROFILE_COUNT`` (at least 0..8, so ``1_SLICE_REV1`` and
  ``7_SLICE_NVL`` too; ``NOT_SUPPORTED`` / ``INVALID_ARGUMENT`` skipped, a profile id answered
  twice listed once), then ``nvmlGpuInstanceGetComputeInstances`` /
  ``nvmlComputeInstanceGetInfo``; the profile's ``sliceCount`` is each CI's size, which
  :meth:`PynvmlAdapter.gpu_instances_with_ci_slices` reports: a CI smaller than its GI
  (``1c.3g.40gb``, made by ``nvidia-smi mig -cci`` or a mig-parted config) is no full MIG device
  of the GI's profile.
* Create: ``nvmlDeviceCreateGpuInstanceWithPlacement(h, id, byref(c_nvmlGpuInstancePlacement_t
  (start, size)))``, then the full-size CI: the compute-instance profile with the GI's slice
  count and the SHARED engine profile, ``nvmlGpuInstanceCreateComputeInstance``.
* Destroy: ``nvmlComputeInstanceDestroy`` for each CI, then ``nvmlGpuInstanceDestroy``.
* MIG devices: ``nvmlDeviceGetMaxMigDeviceCount`` / ``GetMigDeviceHandleByIndex`` (``NOT_FOUND``
  or ``INVALID_ARGUMENT`` for empty indices) / ``GetGpuInstanceId`` / ``GetComputeInstanceId`` /
  ``GetUUID``.
* Processes: ``nvmlDeviceGetComputeRunningProcesses`` on the MIG device handles of the GI (or on
  the GPU handle).
* XID events: :meth:`PynvmlAdapter.watch_xids` creates an event set (``nvmlEventSetCreate``,
  the previous one freed with ``nvmlEventSetFree``) and registers every GPU handle for
  ``nvmlEventTypeXidCriticalError`` (``nvmlDeviceRegisterEvents``); ``NOT_SUPPORTED`` lists the
  GPU as unable to report XIDs, another error as failed.  :meth:`PynvmlAdapter.xid_events` waits
  with ``nvmlEventSetWait_v2(set, timeout_ms)``: ``NVML_ERROR_TIMEOUT`` is no event; an event
  names its GPU by the handle registered (its pointer value; else ``nvmlDeviceGetIndex``; else
  unknown), its XID in ``eventData``, and the GI/CI ids unless ``0xFFFFFFFF``.  The wait runs in
  the agent's watcher thread while passes call the rest (NVML is thread-safe); a GPU reset, which
  shuts NVML down, first frees the event set (a lock keeps it from doing so under a wait) and
  registers the same way again at the next wait.

Every ``pynvml.NVMLError`` becomes :class:`node_agent.nvml.NvmlError` with the same code (and
``pynvml.NVMLLibraryMismatchError``, which is no ``NVMLError``, one with ``FUNCTION_NOT_FOUND``).
The module is imported only without ``--fake``; tests drive it with a fake ``pynvml`` module.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

from node_agent.gpu_reset import NvidiaSmi, reset_gpu
from node_agent.nvml import (
    XID_NOT_MIG_SCOPED,
    ComputeMode,
    GpuInfo,
    GpuInstanceInfo,
    MigDevice,
    NvmlError,
    NvmlErrorCode,
    XidEvent,
    XidRegistration,
)
from planner.catalog import Catalog, default_catalog

__all__ = ["PynvmlAdapter"]

T = TypeVar("T")

_NVML_SUCCESS = 0
"""``nvmlReturn_t`` success, also the activation status of a MIG mode that is active now."""

# compute slices of a GI -> NVML_COMPUTE_INSTANCE_PROFILE_* constant name of its full-size CI
_CI_PROFILE_FOR_SLICES = {
    1: "NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE",
    2: "NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE",
    3: "NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE",
    4: "NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE",
    6: "NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE",
    7: "NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE",
    8: "NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE",
}

_CI_PROFILE_INDEX_FLOOR = 9
"""Compute-instance profile indexes always asked about: 0..8, through ``1_SLICE_REV1`` (0x7) and
``7_SLICE_NVL`` (0x8), whatever ``NVML_COMPUTE_INSTANCE_PROFILE_COUNT`` the binding has."""

log = logging.getLogger(__name__)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _handle_key(h: Any) -> Any:
    """A hashable identity of a device handle: the pointer value of an ``nvmlDevice_t`` (the one
    an event carries equals the one registered), else the handle itself."""
    try:
        return ctypes.cast(h, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return h


def _scope(v: Any) -> int | None:
    """A GI or CI id of an event; ``None`` for :data:`XID_NOT_MIG_SCOPED`."""
    value = int(v)
    return None if value == XID_NOT_MIG_SCOPED else value


class PynvmlAdapter:
    """:class:`node_agent.nvml.Nvml` over the pynvml module (``nvmlInit`` on construction).

    ``catalog`` (default: the built-in one) names the GPU-instance profile indexes asked about
    beyond the binding's ``NVML_GPU_INSTANCE_PROFILE_COUNT``."""

    def __init__(
        self,
        nvml: ModuleType | None = None,
        smi: NvidiaSmi | None = None,
        *,
        catalog: Catalog | None = None,
    ) -> None:
        self._m: Any = nvml if nvml is not None else importlib.import_module("pynvml")
        self._smi = smi if smi is not None else NvidiaSmi()
        self._catalog_gi_indexes = (
            catalog if catalog is not None else default_catalog()
        ).gi_profile_count()
        self._uninitialised = False
        """NVML shut down for a GPU reset did not initialise again (:meth:`_init_after_reset`)."""
        self._call("init", self._m.nvmlInit)
        self._profiles: dict[int, list[Any]] = {}
        self._events: Any = None
        """The XID event set (``None``: none now; made again at the next wait if watching)."""
        self._watching = False
        self._event_gpus: dict[Any, int] = {}
        """:func:`_handle_key` of each registered GPU handle -> its index."""
        self._events_lock = threading.Lock()
        """Held by an event wait and by a GPU reset (which shuts NVML down)."""
        self._resetting = threading.Event()

    def close(self) -> None:
        with self._events_lock:
            self._free_events()
            self._watching = False
        self._call("shutdown", self._m.nvmlShutdown)

    def _call(self, op: str, fn: Callable[..., T], *args: Any) -> T:
        if self._uninitialised and op != "init":
            # NVML did not come back after a GPU reset: try again before anything else
            # (it answered UNINITIALIZED to every call until a restart)
            self._call("init", self._m.nvmlInit)
            self._uninitialised = False
        try:
            return fn(*args)
        except self._m.NVMLError as e:
            raise NvmlError(NvmlErrorCode.of(int(e.value)), op, str(e)) from e
        except getattr(self._m, "NVMLLibraryMismatchError", ()) as e:
            # pynvml's @throwOnVersionMismatch (nvmlDeviceGetComputeRunningProcesses: the _v3 C
            # symbol, which older drivers lack) turns FUNCTION_NOT_FOUND into
            # NVMLLibraryMismatchError, a plain Exception, not an NVMLError subclass.
            raise NvmlError(NvmlErrorCode.FUNCTION_NOT_FOUND, op, str(e)) from e

    def _handle(self, gpu: int) -> Any:
        return self._call("get handle", self._m.nvmlDeviceGetHandleByIndex, gpu)

    # -- GPUs ----------------------------------------------------------------------------

    def gpus(self, *, isolate: bool = False) -> list[GpuInfo]:
        out: list[GpuInfo] = []
        for i in range(self._call("gpus", self._m.nvmlDeviceGetCount)):
            try:
                out.append(self._gpu_info(i))
            except NvmlError as e:
                if not isolate:
                    raise
                out.append(GpuInfo.unreadable(i, e))
        return out

    def _gpu_info(self, i: int) -> GpuInfo:
        m = self._m
        h = self._handle(i)
        pci = self._call("gpus", m.nvmlDeviceGetPciInfo, h)
        mem = self._call("gpus", m.nvmlDeviceGetMemoryInfo, h)
        try:
            current, pending = m.nvmlDeviceGetMigMode(h)
            capable = True
        except m.NVMLError as e:
            if int(e.value) != NvmlErrorCode.NOT_SUPPORTED:
                raise NvmlError(NvmlErrorCode.of(int(e.value)), "gpus", str(e)) from e
            current, pending, capable = 0, 0, False
        mode = self._call("gpus", m.nvmlDeviceGetComputeMode, h)
        return GpuInfo(
            index=i,
            uuid=_text(self._call("gpus", m.nvmlDeviceGetUUID, h)),
            name=_text(self._call("gpus", m.nvmlDeviceGetName, h)),
            pci_device_id=f"{(int(pci.pciDeviceId) >> 16) & 0xFFFF:04X}",
            memory_mib=int(mem.total) // (1024 * 1024),
            mig_enabled=current == m.NVML_DEVICE_MIG_ENABLE,
            mig_capable=capable,
            compute_mode=ComputeMode(int(mode)),
            pending_mig_enabled=pending == m.NVML_DEVICE_MIG_ENABLE,
            pci_bus_id=_text(getattr(pci, "busId", "")),
        )

    def set_compute_mode(self, gpu: int, mode: ComputeMode) -> None:
        self._call(
            "set_compute_mode", self._m.nvmlDeviceSetComputeMode, self._handle(gpu), int(mode)
        )

    def set_mig_mode(self, gpu: int, enabled: bool) -> NvmlErrorCode | None:
        m = self._m
        mode = m.NVML_DEVICE_MIG_ENABLE if enabled else m.NVML_DEVICE_MIG_DISABLE
        self._profiles.pop(gpu, None)  # the profiles answered depend on the MIG mode
        status = self._call("set_mig_mode", m.nvmlDeviceSetMigMode, self._handle(gpu), mode)
        code = int(status or _NVML_SUCCESS)
        return None if code == _NVML_SUCCESS else NvmlErrorCode.of(code)

    def reset_gpu(self, gpu: int) -> None:
        m = self._m
        h = self._handle(gpu)
        bus = _text(self._call("reset_gpu", m.nvmlDeviceGetPciInfo, h).busId)
        try:
            persistence = m.nvmlDeviceGetPersistenceMode(h) == m.NVML_FEATURE_ENABLED
        except m.NVMLError:
            persistence = False  # not readable: try the reset as it is
        self._resetting.set()  # an event wait gives way (the lock is not fair)
        try:
            with self._events_lock:  # no wait on the event set while NVML is shut down
                self._free_events()
                self._call("reset_gpu", m.nvmlShutdown)
                self._uninitialised = True
                try:
                    reset_gpu(self._smi, bus, persistence)
                finally:
                    self._profiles.clear()
                    self._init_after_reset()
        finally:
            self._resetting.clear()

    def _init_after_reset(self) -> None:
        """``nvmlInit`` after a reset.  A failure is logged, not raised: the reset's own error
        (raised through the ``finally`` this runs in) is the one the caller must see, and the
        next call tries the init again (:meth:`_call`)."""
        try:
            self._call("init", self._m.nvmlInit)
            self._uninitialised = False
        except NvmlError as e:
            log.warning(
                "NVML did not initialise again after a GPU reset (%s); the next call tries again",
                e,
            )

    # -- XID events ----------------------------------------------------------------------

    def _free_events(self) -> None:
        """Free the event set, if any (errors ignored: NVML may be going down)."""
        events, self._events = self._events, None
        self._event_gpus = {}
        if events is not None:
            with contextlib.suppress(self._m.NVMLError):
                self._m.nvmlEventSetFree(events)

    def _register_xids(self) -> XidRegistration:
        """Register every GPU's XID events in a new event set.  nvml.h: after
        ``nvmlDeviceRegisterEvents`` answers ``UNKNOWN`` "event set is in undefined state and
        should be freed" -- so the set is made again without that GPU (listed failed), at most
        once per GPU, instead of waiting on it for the agent's whole life."""
        broken: dict[int, NvmlError] = {}
        while True:
            result = self._register_once(broken)
            if isinstance(result, XidRegistration):
                return result
            broken[result[0]] = result[1]

    def _register_once(
        self, broken: dict[int, NvmlError]
    ) -> XidRegistration | tuple[int, NvmlError]:
        m = self._m
        self._free_events()
        self._events = self._call("watch_xids", m.nvmlEventSetCreate)
        registered: list[int] = []
        unsupported: list[int] = []
        failed: list[tuple[int, NvmlError]] = sorted(broken.items())
        for i in range(self._call("watch_xids", m.nvmlDeviceGetCount)):
            if i in broken:
                continue
            try:
                h = self._handle(i)
                self._call(
                    "watch_xids",
                    m.nvmlDeviceRegisterEvents,
                    h,
                    m.nvmlEventTypeXidCriticalError,
                    self._events,
                )
            except NvmlError as e:
                if e.code == NvmlErrorCode.NOT_SUPPORTED:
                    unsupported.append(i)
                elif e.code == NvmlErrorCode.UNKNOWN:
                    return i, e  # the set is undefined now: start over without this GPU
                else:
                    failed.append((i, e))
                continue
            self._event_gpus[_handle_key(h)] = i
            registered.append(i)
        return XidRegistration(tuple(registered), tuple(unsupported), tuple(sorted(failed)))

    def watch_xids(self) -> XidRegistration:
        with self._events_lock:
            self._watching = True
            return self._register_xids()

    def xid_events(self, timeout_ms: int) -> list[XidEvent]:
        m = self._m
        if self._resetting.is_set():
            time.sleep(min(timeout_ms, 50) / 1000)
            return []
        with self._events_lock:
            if not self._watching:
                raise NvmlError(NvmlErrorCode.UNINITIALIZED, "xid_events", "watch_xids first")
            if self._events is None:  # freed by a GPU reset
                self._register_xids()
            try:
                data = m.nvmlEventSetWait_v2(self._events, max(0, int(timeout_ms)))
            except m.NVMLError as e:
                if int(e.value) == NvmlErrorCode.TIMEOUT:
                    return []
                raise NvmlError(NvmlErrorCode.of(int(e.value)), "xid_events", str(e)) from e
            if int(data.eventType) != m.nvmlEventTypeXidCriticalError:
                return []  # only XIDs are registered; anything else is not ours
            gpu = self._event_gpus.get(_handle_key(data.device))
        if gpu is None:
            try:
                gpu = int(m.nvmlDeviceGetIndex(data.device))
            except (m.NVMLError, AttributeError):
                gpu = None
        return [
            XidEvent(
                gpu, int(data.eventData), _scope(data.gpuInstanceId), _scope(data.computeInstanceId)
            )
        ]

    # -- GPU instances -------------------------------------------------------------------

    def _gi_profiles(self, gpu: int, h: Any) -> list[Any]:
        """The GI profile infos the GPU supports (cached per GPU while its MIG mode stays).

        With MIG mode off NVML answers ``NOT_SUPPORTED`` for every profile; that empty answer
        is not kept, so the profiles are read again once MIG mode is on (a pending mode that
        became current at a reset, or Hopper's immediate switch).  The indexes asked about reach
        past the binding's ``NVML_GPU_INSTANCE_PROFILE_COUNT`` to every index the catalog knows:
        nvidia-ml-py 12.535 stops at 0xA, yet the driver (R575+) answers the RTX PRO ``+gfx``
        indices 0xA/0xB; an index the GPU lacks answers ``NOT_SUPPORTED`` or
        ``INVALID_ARGUMENT`` and is skipped."""
        if gpu not in self._profiles:
            m = self._m
            infos = []
            count = max(int(m.NVML_GPU_INSTANCE_PROFILE_COUNT), self._catalog_gi_indexes)
            for idx in range(count):
                try:
                    infos.append(m.nvmlDeviceGetGpuInstanceProfileInfo(h, idx))
                except m.NVMLError as e:
                    if int(e.value) in (
                        NvmlErrorCode.NOT_SUPPORTED,
                        NvmlErrorCode.INVALID_ARGUMENT,
                    ):
                        continue
                    raise NvmlError(NvmlErrorCode.of(int(e.value)), "profiles", str(e)) from e
            if not infos:
                return infos
            self._profiles[gpu] = infos
        return self._profiles[gpu]

    def _gi_handles(self, gpu: int) -> list[tuple[Any, Any]]:
        """``(GI handle, GI info)`` for every GPU instance, enumerated per profile."""
        m = self._m
        h = self._handle(gpu)
        out: list[tuple[Any, Any]] = []
        for prof in self._gi_profiles(gpu, h):
            n = max(int(prof.instanceCount), 1)
            arr = (m.c_nvmlGpuInstance_t * n)()
            count = ctypes.c_uint(0)
            self._call(
                "gpu_instances", m.nvmlDeviceGetGpuInstances, h, prof.id, arr, ctypes.byref(count)
            )
            for k in range(count.value):
                gi = arr[k]
                out.append((gi, self._call("gpu_instances", m.nvmlGpuInstanceGetInfo, gi)))
        return out

    def _compute_instances(self, gi: Any) -> list[tuple[Any, int, int]]:
        """``(CI handle, CI id, compute slices)`` of every compute instance of a GI, its size
        the ``sliceCount`` of the compute-instance profile it is listed under.

        Every profile index is asked about, as NVIDIA's go-nvlib visits them: a CI made under
        ``1_SLICE_REV1`` (0x7) or ``7_SLICE_NVL`` (0x8) -- by an admin's ``nvidia-smi mig -cci``
        or a go-nvlib tool -- is listed only under that profile, and a GI read without it would
        look CI-less (and idle) while its MIG device runs processes."""
        m = self._m
        out: list[tuple[Any, int, int]] = []
        seen: set[int] = set()
        count = max(
            int(getattr(m, "NVML_COMPUTE_INSTANCE_PROFILE_COUNT", 0)), _CI_PROFILE_INDEX_FLOOR
        )
        for idx in range(count):
            try:
                info = m.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi, idx, m.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
                )
            except m.NVMLError as e:
                if int(e.value) in (NvmlErrorCode.NOT_SUPPORTED, NvmlErrorCode.INVALID_ARGUMENT):
                    continue  # profile not valid for this GI (or unknown to this driver)
                # anything else (GPU lost, no permission) must not read as "no compute
                # instance": the GI would look idle and a pass would try to destroy it under
                # its processes
                raise NvmlError(NvmlErrorCode.of(int(e.value)), "compute_instances", str(e)) from e
            if int(info.id) in seen:
                continue  # the same profile under a second index: its CIs are listed already
            seen.add(int(info.id))
            n = max(int(info.instanceCount), 1)
            arr = (m.c_nvmlComputeInstance_t * n)()
            found = ctypes.c_uint(0)
            self._call(
                "compute_instances",
                m.nvmlGpuInstanceGetComputeInstances,
                gi,
                info.id,
                arr,
                ctypes.byref(found),
            )
            size = int(info.sliceCount)
            for k in range(found.value):
                ci = arr[k]
                ci_info = self._call("compute_instances", m.nvmlComputeInstanceGetInfo, ci)
                out.append((ci, int(ci_info.id), size))
        return out

    def gpu_instances(self, gpu: int) -> list[GpuInstanceInfo]:
        return [gi for gi, _ in self.gpu_instances_with_ci_slices(gpu)]

    def gpu_instances_with_ci_slices(
        self, gpu: int
    ) -> list[tuple[GpuInstanceInfo, dict[int, int]]]:
        """Every GI, with the compute slices of each of its CIs (CI id -> slices)."""
        out = []
        for gi, info in self._gi_handles(gpu):
            slices = {cid: size for _, cid, size in self._compute_instances(gi)}
            out.append(
                (
                    GpuInstanceInfo(
                        gpu_index=gpu,
                        gi_id=int(info.id),
                        profile_id=int(info.profileId),
                        start=int(info.placement.start),
                        size=int(info.placement.size),
                        compute_instances=tuple(sorted(slices)),
                    ),
                    dict(sorted(slices.items())),
                )
            )
        return sorted(out, key=lambda x: x[0].gi_id)

    def _gi(self, gpu: int, gi_id: int, op: str) -> Any:
        for gi, info in self._gi_handles(gpu):
            if int(info.id) == gi_id:
                return gi
        raise NvmlError(NvmlErrorCode.NOT_FOUND, op, f"GPU {gpu} has no GPU instance {gi_id}")

    def create_gpu_instance(self, gpu: int, profile_id: int, start: int, size: int) -> int:
        m = self._m
        placement = m.c_nvmlGpuInstancePlacement_t()
        placement.start = start
        placement.size = size
        gi = self._call(
            "create_gpu_instance",
            m.nvmlDeviceCreateGpuInstanceWithPlacement,
            self._handle(gpu),
            profile_id,
            ctypes.byref(placement),
        )
        return int(self._call("create_gpu_instance", m.nvmlGpuInstanceGetInfo, gi).id)

    def create_compute_instance(self, gpu: int, gi_id: int) -> int:
        m = self._m
        gi = self._gi(gpu, gi_id, "create_compute_instance")
        h = self._handle(gpu)
        gi_info = self._call("create_compute_instance", m.nvmlGpuInstanceGetInfo, gi)
        slices = next(
            int(p.sliceCount) for p in self._gi_profiles(gpu, h) if p.id == gi_info.profileId
        )
        ci_prof = self._call(
            "create_compute_instance",
            m.nvmlGpuInstanceGetComputeInstanceProfileInfo,
            gi,
            getattr(m, _CI_PROFILE_FOR_SLICES[slices]),
            m.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
        )
        ci = self._call(
            "create_compute_instance", m.nvmlGpuInstanceCreateComputeInstance, gi, ci_prof.id
        )
        return int(self._call("create_compute_instance", m.nvmlComputeInstanceGetInfo, ci).id)

    def destroy_compute_instance(self, gpu: int, gi_id: int, ci_id: int) -> None:
        gi = self._gi(gpu, gi_id, "destroy_compute_instance")
        for ci, cid, _ in self._compute_instances(gi):
            if cid == ci_id:
                self._call("destroy_compute_instance", self._m.nvmlComputeInstanceDestroy, ci)
                return
        raise NvmlError(NvmlErrorCode.NOT_FOUND, "destroy_compute_instance", f"no CI {ci_id}")

    def destroy_gpu_instance(self, gpu: int, gi_id: int) -> None:
        gi = self._gi(gpu, gi_id, "destroy_gpu_instance")
        self._call("destroy_gpu_instance", self._m.nvmlGpuInstanceDestroy, gi)

    # -- MIG devices and processes -------------------------------------------------------

    def _mig_handles(self, gpu: int) -> list[tuple[Any, int, int]]:
        m = self._m
        h = self._handle(gpu)
        out: list[tuple[Any, int, int]] = []
        for k in range(self._call("mig_devices", m.nvmlDeviceGetMaxMigDeviceCount, h)):
            try:
                mh = m.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
            except m.NVMLError as e:
                # an empty index: NOT_FOUND, or INVALID_ARGUMENT on some drivers (NVIDIA's
                # go-nvlib VisitMigDevices skips both; pynvml raises the C return as it is)
                if int(e.value) in (NvmlErrorCode.NOT_FOUND, NvmlErrorCode.INVALID_ARGUMENT):
                    continue
                raise NvmlError(NvmlErrorCode.of(int(e.value)), "mig_devices", str(e)) from e
            gi = self._call("mig_devices", m.nvmlDeviceGetGpuInstanceId, mh)
            ci = self._call("mig_devices", m.nvmlDeviceGetComputeInstanceId, mh)
            out.append((mh, int(gi), int(ci)))
        return out

    def mig_devices(self, gpu: int) -> list[MigDevice]:
        return [
            MigDevice(gpu, gi, ci, _text(self._call("mig_devices", self._m.nvmlDeviceGetUUID, mh)))
            for mh, gi, ci in self._mig_handles(gpu)
        ]

    def process_name(self, pid: int) -> str:
        try:
            return _text(self._m.nvmlSystemGetProcessName(pid))
        except self._m.NVMLError:
            return ""

    def running_processes(self, gpu: int, gi_id: int | None = None) -> list[int]:
        m = self._m
        if gi_id is None:
            handles = [self._handle(gpu)]
        else:
            handles = [mh for mh, gi, _ in self._mig_handles(gpu) if gi == gi_id]
        pids: set[int] = set()
        for h in handles:
            procs = self._call("running_processes", m.nvmlDeviceGetComputeRunningProcesses, h)
            pids |= {int(p.pid) for p in procs}
        return sorted(pids)
