"""The NVML port: the few driver operations the node agent needs, as a typed Protocol.

Model
-----
GPUs are addressed by their NVML index, GPU instances (GI) by ``(gpu index, GI id)`` and compute
instances (CI) by ``(gpu index, GI id, CI id)`` -- opaque driver handles stay inside the
adapters.  A GI occupies the memory slots ``[start, start + size)`` (facts/mig.md); every GI the
agent creates holds exactly one full-size CI with the SHARED engine profile, and that CI is the
*MIG device* advertised to the kubelet under its UUID.

The operations and their driver rules (both adapters must behave alike):

* :meth:`Nvml.gpus` -- index, UUID, name, PCI device id, memory, current *and pending* MIG
  mode (``nvmlDeviceGetMigMode`` -> ``[current, pending]``), compute mode.  A failing read
  raises; with ``isolate=True`` only a failing device count does (NVML itself down), and a GPU
  whose own reads fail (e.g. ``GPU_IS_LOST`` at its handle or MIG mode) is listed with just its
  index and :attr:`GpuInfo.read_error`, so the reconciler can isolate it.
* :meth:`Nvml.set_mig_mode` -- a *change* of mode only on a GPU without GIs, else ``IN_USE``.
  Returns the driver's *activation status* (nvml.h ``nvmlDeviceSetMigMode``): ``None``
  (``NVML_SUCCESS``) when the new mode is current, else the code saying why it is not:
  ``RESET_REQUIRED`` (pass-through VM: pending until a reset or reboot), ``IN_USE`` (the GPU
  was not idle: on Ampere the change is left pending, on Hopper+ nothing changed and the caller
  asks again once idle; see :mod:`node_agent.mig_activation`) -- read the mode back to tell.
  Asking for the current mode cancels a pending change.
* :meth:`Nvml.reset_gpu` -- reset an idle GPU (no process, no GI, else ``IN_USE``), making a
  pending MIG mode current.  NVML has no public reset call: both adapters run the host
  driver's ``nvidia-smi -r -i <bus id>`` as NVIDIA's mig-parted does
  (:mod:`node_agent.gpu_reset`); without the tool the reset fails with ``NOT_SUPPORTED``.
* :meth:`Nvml.process_name` -- ``nvmlSystemGetProcessName``: the name of a pid that
  :meth:`Nvml.running_processes` listed (``""`` if unknown), to name what blocks a reset.
* :meth:`Nvml.set_compute_mode` -- ``nvmlDeviceSetComputeMode`` (root).  MPS wants its GPU in
  ``EXCLUSIVE_PROCESS`` before the control daemon starts, so that only the MPS server opens a
  context on it (facts/mig.md).  The mode does not survive a reboot or driver reload.  The
  driver applies it to contexts created afterwards; the reconciler therefore changes it only on
  a GPU without processes.
* :meth:`Nvml.gpu_instances` -- every GI with its profile id, placement and CI ids.
* :meth:`Nvml.create_gpu_instance` -- at an exact placement; an occupied placement or an
  exhausted profile fails with ``INSUFFICIENT_RESOURCES``; a start the profile does not allow
  fails with ``INVALID_ARGUMENT``; MIG disabled fails with ``NOT_SUPPORTED``.
* :meth:`Nvml.create_compute_instance` -- the full-size SHARED CI of a GI.
* :meth:`Nvml.destroy_compute_instance` / :meth:`Nvml.destroy_gpu_instance` -- CI first (a GI
  that still has CIs fails with ``IN_USE``), a CI with running processes fails with ``IN_USE``.
* :meth:`Nvml.mig_devices` -- ``(GI id, CI id, MIG UUID)`` of every MIG device.
* :meth:`Nvml.running_processes` -- pids on a GI's MIG devices, or on the whole GPU.
* :meth:`Nvml.watch_xids` -- register every GPU for XID critical-error events
  (``nvmlDeviceRegisterEvents`` with ``nvmlEventTypeXidCriticalError`` into one event set; again:
  a fresh set).  A GPU that answers ``NOT_SUPPORTED`` cannot report XIDs and is listed in
  :attr:`XidRegistration.unsupported`; one whose registration fails otherwise (``GPU_IS_LOST``)
  in :attr:`XidRegistration.failed`; neither raises.
* :meth:`Nvml.xid_events` -- wait at most ``timeout_ms`` for XID events of the registered GPUs
  (``nvmlEventSetWait_v2``); ``TIMEOUT`` is "no event" (``[]``), any other error raises.  Only
  registered GPUs report events.  An event scoped to a MIG instance carries its GI and CI ids
  (``nvmlEventData_t.gpuInstanceId`` / ``computeInstanceId``; :data:`XID_NOT_MIG_SCOPED` there
  means "not MIG-scoped": ``None``).  This is the one call made from a worker thread beside
  the reconcile passes (NVML is thread-safe); both adapters allow it.

Errors are :class:`NvmlError` carrying an :class:`NvmlErrorCode` whose values equal pynvml's
``NVML_ERROR_*`` constants, so the real adapter maps ``pynvml.NVMLError.value`` one to one.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

__all__ = [
    "XID_NOT_MIG_SCOPED",
    "ComputeMode",
    "GpuInfo",
    "GpuInstanceInfo",
    "MigDevice",
    "Nvml",
    "NvmlError",
    "NvmlErrorCode",
    "XidEvent",
    "XidRegistration",
]


class NvmlErrorCode(IntEnum):
    """NVML return codes (values identical to ``pynvml.NVML_ERROR_*``)."""

    UNINITIALIZED = 1
    INVALID_ARGUMENT = 2
    NOT_SUPPORTED = 3
    NO_PERMISSION = 4
    ALREADY_INITIALIZED = 5
    NOT_FOUND = 6
    INSUFFICIENT_SIZE = 7
    INSUFFICIENT_POWER = 8
    DRIVER_NOT_LOADED = 9
    TIMEOUT = 10
    IRQ_ISSUE = 11
    LIBRARY_NOT_FOUND = 12
    FUNCTION_NOT_FOUND = 13
    CORRUPTED_INFOROM = 14
    GPU_IS_LOST = 15
    RESET_REQUIRED = 16
    OPERATING_SYSTEM = 17
    LIB_RM_VERSION_MISMATCH = 18
    IN_USE = 19
    MEMORY = 20
    NO_DATA = 21
    VGPU_ECC_NOT_SUPPORTED = 22
    INSUFFICIENT_RESOURCES = 23
    FREQ_NOT_SUPPORTED = 24
    ARGUMENT_VERSION_MISMATCH = 25
    DEPRECATED = 26
    NOT_READY = 27
    GPU_NOT_FOUND = 28
    INVALID_STATE = 29
    RESET_TYPE_NOT_SUPPORTED = 30
    UNKNOWN = 999

    @classmethod
    def of(cls, value: int) -> NvmlErrorCode:
        try:
            return cls(value)
        except ValueError:
            return cls.UNKNOWN


class NvmlError(Exception):
    """An NVML call failed. ``code`` is the driver's return code; ``op`` names the call."""

    def __init__(self, code: NvmlErrorCode, op: str, detail: str = "") -> None:
        self.code = code
        self.op = op
        self.detail = detail
        text = f"{op}: NVML_ERROR_{code.name}"
        super().__init__(f"{text} ({detail})" if detail else text)


class ComputeMode(IntEnum):
    """GPU compute modes (values identical to ``pynvml.NVML_COMPUTEMODE_*``)."""

    DEFAULT = 0
    """Any number of contexts, from any processes."""
    EXCLUSIVE_THREAD = 1
    """Deprecated."""
    PROHIBITED = 2
    """No compute context at all."""
    EXCLUSIVE_PROCESS = 3
    """One context (one process, e.g. the MPS server) at a time."""


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """One physical GPU as NVML reports it."""

    index: int
    uuid: str
    name: str
    """``nvmlDeviceGetName``, e.g. ``NVIDIA A100-SXM4-80GB``."""
    pci_device_id: str
    """Four upper-case hex digits, e.g. ``20B2`` (from ``pciDeviceId`` ``0x20B210DE``)."""
    memory_mib: int
    mig_enabled: bool
    """Current MIG mode."""
    mig_capable: bool = True
    compute_mode: ComputeMode = ComputeMode.DEFAULT
    """``nvmlDeviceGetComputeMode``."""
    pending_mig_enabled: bool | None = None
    """Pending MIG mode (the mode after the next GPU reset or reboot); ``None``: as current."""
    pci_bus_id: str = ""
    """``nvmlDeviceGetPciInfo().busId``, e.g. ``00000000:07:00.0`` (what ``nvidia-smi -i`` takes)."""
    read_error: NvmlError | None = None
    """``gpus(isolate=True)`` only: reading this GPU failed; every field but ``index`` is
    unknown (empty)."""

    @classmethod
    def unreadable(cls, index: int, error: NvmlError) -> GpuInfo:
        """The ``gpus(isolate=True)`` entry of GPU ``index`` whose reads failed with ``error``."""
        return cls(index, "", "", "", 0, False, mig_capable=False, read_error=error)

    @property
    def mig_target(self) -> bool:
        """The MIG mode the GPU is heading for: the pending one, else the current one."""
        return self.mig_enabled if self.pending_mig_enabled is None else self.pending_mig_enabled

    @property
    def mig_pending(self) -> bool:
        """A MIG-mode change was requested and waits for a GPU reset (Ampere)."""
        return self.mig_target != self.mig_enabled


@dataclass(frozen=True, slots=True)
class GpuInstanceInfo:
    """One GPU instance: profile, placement and the ids of its compute instances."""

    gpu_index: int
    gi_id: int
    profile_id: int
    start: int
    size: int
    compute_instances: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class MigDevice:
    """A MIG device (one CI of one GI) and the UUID the kubelet sees."""

    gpu_index: int
    gi_id: int
    ci_id: int
    uuid: str


XID_NOT_MIG_SCOPED = 0xFFFFFFFF
"""``nvmlEventData_t.gpuInstanceId`` / ``computeInstanceId`` of an event not scoped to a MIG
instance."""


@dataclass(frozen=True, slots=True)
class XidEvent:
    """One XID critical-error event as NVML reported it."""

    gpu: int | None
    """The GPU's NVML index; ``None``: the adapter could not tell which GPU."""
    xid: int
    """The XID code (``nvmlEventData_t.eventData``)."""
    gi_id: int | None = None
    """The GPU instance the event is scoped to; ``None``: not MIG-scoped (the whole GPU)."""
    ci_id: int | None = None
    """The compute instance the event is scoped to; ``None``: not MIG-scoped."""


@dataclass(frozen=True, slots=True)
class XidRegistration:
    """What :meth:`Nvml.watch_xids` registered."""

    registered: tuple[int, ...]
    """GPUs that report XID events."""
    unsupported: tuple[int, ...] = ()
    """GPUs that cannot report XIDs (``NOT_SUPPORTED``)."""
    failed: tuple[tuple[int, NvmlError], ...] = ()
    """GPUs whose registration failed otherwise, with the error."""


class Nvml(Protocol):
    """The driver operations the agent uses (see the module docstring for the rules)."""

    def gpus(self, *, isolate: bool = False) -> list[GpuInfo]:
        """Every GPU; ``isolate``: a GPU whose reads fail is listed with ``read_error``."""
        ...

    def set_mig_mode(self, gpu: int, enabled: bool) -> NvmlErrorCode | None:
        """Request MIG mode; return the activation status (``None``: active now)."""
        ...

    def reset_gpu(self, gpu: int) -> None:
        """Reset an idle GPU: a pending MIG mode becomes current."""
        ...

    def set_compute_mode(self, gpu: int, mode: ComputeMode) -> None: ...

    def gpu_instances(self, gpu: int) -> list[GpuInstanceInfo]: ...

    def create_gpu_instance(self, gpu: int, profile_id: int, start: int, size: int) -> int:
        """Create a GI at exactly ``(start, size)``; return its GI id."""
        ...

    def create_compute_instance(self, gpu: int, gi_id: int) -> int:
        """Create the full-size SHARED-engine CI of a GI; return its CI id."""
        ...

    def destroy_compute_instance(self, gpu: int, gi_id: int, ci_id: int) -> None: ...

    def destroy_gpu_instance(self, gpu: int, gi_id: int) -> None: ...

    def mig_devices(self, gpu: int) -> list[MigDevice]: ...

    def running_processes(self, gpu: int, gi_id: int | None = None) -> list[int]:
        """Pids running on GI ``gi_id``'s MIG devices, or on the whole GPU if ``None``."""
        ...

    def process_name(self, pid: int) -> str:
        """The process name of ``pid`` (``""`` if NVML cannot tell)."""
        ...

    def watch_xids(self) -> XidRegistration:
        """Register every GPU for XID critical-error events (a fresh event set)."""
        ...

    def xid_events(self, timeout_ms: int) -> list[XidEvent]:
        """XID events of registered GPUs, waiting at most ``timeout_ms``; ``[]`` on timeout."""
        ...
