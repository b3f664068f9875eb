"""An in-memory NVML built from the GPU catalog, enforcing the driver's MIG rules, with faults.

Model
-----
A :class:`FakeNvml` holds GPUs of catalog models (:class:`planner.catalog.GpuModel`).  Each GPU
has a MIG mode, GPU instances (profile, start, compute instances with their MIG UUIDs) and
processes (a pid on a MIG device, or on the whole GPU).  The rules are those of
shared/facts/mig.md, checked here independently of :mod:`planner.geometry` (a property test
compares the two):

==========================================  ==========================================
operation                                   fails with
==========================================  ==========================================
create GI, MIG mode off / not MIG-capable   ``NOT_SUPPORTED``
create GI, unknown profile id, wrong size   ``INVALID_ARGUMENT``
create GI, start not allowed for profile    ``INVALID_ARGUMENT``
create GI, slot taken, max count reached,   ``INSUFFICIENT_RESOURCES``
second ``+me``, compute slices exhausted
create CI of a size the GI has no profile   ``NOT_SUPPORTED``
for (larger than the GI, or not 1/2/3/4/6/
7/8 compute slices)
create CI beyond the GI's compute slices    ``INSUFFICIENT_RESOURCES``
(e.g. a full-size CI on a GI with a CI)
destroy CI with processes on it             ``IN_USE``
destroy GI that still has CIs               ``IN_USE``
change MIG mode with GIs                    ``IN_USE``
set an exclusive compute mode, MIG mode on  ``NOT_SUPPORTED``
reset GPU with GIs, processes, persistence  ``IN_USE``
reset GPU without the nvidia-smi tool       ``NOT_SUPPORTED``
set compute mode on an unknown GPU          ``INVALID_ARGUMENT``
unknown GPU index / GI id / CI id           ``INVALID_ARGUMENT`` / ``NOT_FOUND``
==========================================  ==========================================

GI ids are the smallest free id (the driver reuses ids too); every CI gets a fresh MIG UUID
and the smallest free CI id.  A CI is the GI's full size (the port's
:meth:`FakeNvml.create_compute_instance`) unless ``slices`` asks for a smaller compute-instance
profile, as an admin's ``nvidia-smi mig -cci`` or a mig-parted ``1c.3g.40gb`` config makes one
(NVIDIA's ``<c>c.<g>g.<gb>gb``): the CIs of a GI share its compute slices.
:meth:`FakeNvml.gpu_instances_with_ci_slices` reports every CI's compute slices as the real
adapter reads them from the CI profile it is listed under
(:meth:`node_agent.nvml_pynvml.PynvmlAdapter.gpu_instances_with_ci_slices`).
The compute mode (``DEFAULT`` at start) can be set at any time: the driver applies it to
contexts created afterwards.  While MIG mode is on (current) an exclusive mode
(``EXCLUSIVE_PROCESS``, ``EXCLUSIVE_THREAD``) answers ``NOT_SUPPORTED`` and the mode stays as it
was, as ``nvmlDeviceSetComputeMode`` does on a MIG-enabled GPU.  Whether MPS may start on a GPU
in the wrong mode is :class:`node_agent.mps.FakeSupervisor`'s to enforce.

MIG mode, as ``nvmlDeviceSetMigMode`` (nvml.h) answers it: a change of mode on a GPU with GPU
instances fails (``IN_USE``); otherwise the call *succeeds* and returns an *activation status*
-- ``None`` (``NVML_SUCCESS``: the mode is current now), or the code saying why it is not.  Per
family (:func:`node_agent.mig_activation.mig_activation` of the GPU's model; facts/mig.md:
"Ampere: GPU reset, persistent across reboot; Hopper+: no reset"):

* **Ampere** (A100, A30): the driver activates a change by resetting the GPU itself.  Idle (no
  process, persistence mode off): current at once (``None``).  Busy (a process, or persistence
  mode holding the device): the mode is left *pending* (``gpus()`` shows ``[current,
  pending]`` apart) with activation ``IN_USE``, until :meth:`FakeNvml.reset_gpu` (idle GPU
  only) or :meth:`FakeNvml.reboot` applies it.  ``passthrough=True`` is a pass-through VM,
  where the driver cannot reset the GPU: every change is left pending with
  ``RESET_REQUIRED`` (nvml.h gives that status only there); :meth:`FakeNvml.reset_gpu` still
  applies it (a hypervisor that exposes the reset).  The mode persists across reboots.

GPU reset, as production does it: :meth:`FakeNvml.reset_gpu` runs the agent's own
:func:`node_agent.gpu_reset.reset_gpu` procedure against :meth:`FakeNvml.nvidia_smi`, an
emulation of the host driver's ``nvidia-smi -r -i BUS`` / ``-pm 0|1 -i BUS`` with the real
tool's exit codes and messages: a GPU with GPU instances, processes or persistence mode on
answers "In use by another client" (exit 255); ``tool_present=False`` is a node whose agent was
not given the tool (it cannot be run: exit 127).  Each GPU has a PCI bus id
(``00000000:<07 + index>:00.0``) and persistence mode (off unless set with
:meth:`FakeNvml.set_persistence_mode`).
* **Hopper and later**: no reset is needed.  Idle: a change is current at once (``None``);
  with processes on the GPU nothing changes and the activation status is ``IN_USE`` (nvml.h:
  "the caller is expected to idle the device and retry setting the mode").  A reboot brings
  MIG mode back to disabled.

Asking for the current mode cancels a pending change.  :meth:`FakeNvml.reboot` (node reboot /
driver reload) also drops every instance and process (MIG instances never survive a reboot) and
resets the compute mode to ``DEFAULT``.

Fault injection
---------------
:meth:`FakeNvml.inject` makes calls of one operation (or ``"*"``: any) fail ``times`` times
(``None``: always) with probability ``probability``, either before the call has any effect or
*after* it (``after=True``: the driver did the work, the caller sees an error -- a timeout).
``error`` raises an arbitrary exception instead of :class:`NvmlError` (e.g. a simulated agent
crash).  ``gpu=N`` scopes a fault to one GPU (the calls whose first argument is GPU ``N``,
and GPU ``N``'s entry in ``gpus()``): a GPU lost (``GPU_IS_LOST``) or unreadable while the
others work.  ``gpus()`` then raises, as the real adapter does, or with ``isolate=True`` lists
that GPU with only its index and ``read_error``.  ``hooks`` run before every call with
``(op, args)``: tests use them to interleave other actors (pods being allocated) with the
agent's calls.

XID events
----------
:meth:`FakeNvml.emit_xid` is the driver reporting an XID critical error on a GPU (scoped to a
MIG instance with ``gi``/``ci``).  As in NVML, only GPUs registered by
:meth:`FakeNvml.watch_xids` report events (an event for another GPU is dropped: ``emit_xid``
returns ``False``), and GPUs in :attr:`FakeNvml.xid_unsupported` cannot be registered
(``NOT_SUPPORTED``).  :meth:`FakeNvml.xid_events` blocks, like ``nvmlEventSetWait``, until an
event is queued or its timeout passes; it may be called from another thread than the rest (the
agent's watcher does), so the queue is guarded by a lock, and it is neither hooked nor subject
to injected faults.
"""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from node_agent.gpu_reset import NvidiaSmi, reset_gpu
from node_agent.mig_activation import MigActivation, mig_activation
from node_agent.nvml import (
    ComputeMode,
    GpuInfo,
    GpuInstanceInfo,
    MigDevice,
    NvmlError,
    NvmlErrorCode,
    XidEvent,
    XidRegistration,
)
from planner.catalog import GpuModel, MigProfile

__all__ = ["FakeNvml", "Fault"]

Hook = Callable[[str, tuple[int, ...]], None]

OPS = (
    "gpus",
    "set_mig_mode",
    "reset_gpu",
    "set_compute_mode",
    "gpu_instances",
    "create_gpu_instance",
    "create_compute_instance",
    "destroy_compute_instance",
    "destroy_gpu_instance",
    "mig_devices",
    "running_processes",
)


@dataclass
class Fault:
    """One injected fault (see the module docstring)."""

    op: str
    code: NvmlErrorCode = NvmlErrorCode.UNKNOWN
    times: int | None = 1
    probability: float = 1.0
    after: bool = False
    error: Callable[[], BaseException] | None = None
    fired: int = 0
    gpu: int | None = None
    """Only calls on this GPU (their first argument) fail; ``None``: any call."""

    def exhausted(self) -> bool:
        return self.times is not None and self.fired >= self.times


@dataclass
class _Gi:
    gi_id: int
    profile: MigProfile
    start: int
    cis: dict[int, str] = field(default_factory=dict)
    """CI id -> MIG device UUID."""
    ci_slices: dict[int, int] = field(default_factory=dict)
    """CI id -> its compute slices; a CI not listed is full-size (the profile's compute)."""

    def slices_of(self, ci_id: int) -> int:
        return self.ci_slices.get(ci_id, self.profile.compute)


@dataclass
class _Gpu:
    index: int
    model: GpuModel
    uuid: str
    mig_enabled: bool
    """Current MIG mode."""
    mig_pending_mode: bool
    """Pending MIG mode (equal to the current one when no change waits for a reset)."""
    gis: dict[int, _Gi] = field(default_factory=dict)
    compute_mode: ComputeMode = ComputeMode.DEFAULT
    persistence: bool = False
    """Persistence mode (``nvidia-smi -pm``): holds the device, so a reset is refused."""

    @property
    def bus_id(self) -> str:
        return f"00000000:{0x07 + self.index:02X}:00.0"

    @property
    def activation(self) -> MigActivation:
        return mig_activation(self.model)


@dataclass(frozen=True, slots=True)
class _Proc:
    gpu: int
    gi_id: int | None
    ci_id: int | None
    name: str = "cuda-app"


CI_PROFILE_SLICES = (1, 2, 3, 4, 6, 7, 8)
"""The compute slices of NVML's compute-instance profiles (``NVML_COMPUTE_INSTANCE_PROFILE_<n>_
SLICE``); a GI offers those no larger than itself."""


class FakeNvml:
    """In-memory NVML (implements :class:`node_agent.nvml.Nvml`)."""

    def __init__(
        self,
        models: Sequence[GpuModel],
        *,
        mig_enabled: bool = False,
        seed: int = 0,
        rng: random.Random | None = None,
        tool_present: bool = True,
        passthrough: bool = False,
    ) -> None:
        self._rng = rng if rng is not None else random.Random(seed)
        self.tool_present = tool_present
        """The agent was given the host driver's nvidia-smi (else a reset cannot run)."""
        self.passthrough = passthrough
        """A pass-through VM: an Ampere MIG-mode change answers ``RESET_REQUIRED`` (pending)."""
        self._gpus: list[_Gpu] = []
        for i, m in enumerate(models):
            on = mig_enabled and m.mig_capable
            self._gpus.append(_Gpu(i, m, self._uuid("GPU"), mig_enabled=on, mig_pending_mode=on))
        self._procs: dict[int, _Proc] = {}
        self._next_pid = 1000
        self.faults: list[Fault] = []
        self._args: tuple[int, ...] = ()
        """The arguments of the call in progress (GPU-scoped faults after it)."""
        self.hooks: list[Hook] = []
        self.calls = 0
        self.faults_raised = 0
        self.xid_unsupported: set[int] = set()
        """GPUs that cannot report XID events (registration answers ``NOT_SUPPORTED``)."""
        self._xid_watched: frozenset[int] = frozenset()
        self._xid_queue: list[XidEvent] = []
        self._xid_ready = threading.Condition()

    # -- fault injection ---------------------------------------------------------------

    def inject(
        self,
        op: str,
        code: NvmlErrorCode = NvmlErrorCode.UNKNOWN,
        *,
        times: int | None = 1,
        probability: float = 1.0,
        after: bool = False,
        error: Callable[[], BaseException] | None = None,
        gpu: int | None = None,
    ) -> Fault:
        if op != "*" and op not in OPS:
            raise ValueError(f"cannot inject a fault into unknown NVML operation {op!r}; use {OPS}")
        f = Fault(op, code, times, probability, after, error, gpu=gpu)
        self.faults.append(f)
        return f

    def clear_faults(self) -> None:
        self.faults.clear()

    def _maybe_fail(
        self, op: str, after: bool, args: tuple[int, ...] = (), scoped: bool = False
    ) -> None:
        """Raise the first fault that applies; ``scoped``: only GPU-scoped faults (one GPU's
        entry in ``gpus()``)."""
        for f in self.faults:
            if f.after != after or (f.op != "*" and f.op != op) or f.exhausted():
                continue
            if (f.gpu is None and scoped) or (f.gpu is not None and args[:1] != (f.gpu,)):
                continue
            if f.probability < 1.0 and self._rng.random() >= f.probability:
                continue
            f.fired += 1
            self.faults_raised += 1
            if f.error is not None:
                raise f.error()
            raise NvmlError(f.code, op, "injected fault")

    def _enter(self, op: str, *args: int) -> None:
        self.calls += 1
        for h in self.hooks:
            h(op, args)
        if self.faults:
            self._maybe_fail(op, False, args)
        self._args = args

    def _leave(self, op: str) -> None:
        if self.faults:
            self._maybe_fail(op, True, self._args)

    # -- helpers -----------------------------------------------------------------------

    def _uuid(self, prefix: str) -> str:
        return f"{prefix}-{uuid.UUID(int=self._rng.getrandbits(128), version=4)}"

    def _gpu(self, op: str, index: int) -> _Gpu:
        if not 0 <= index < len(self._gpus):
            raise NvmlError(NvmlErrorCode.INVALID_ARGUMENT, op, f"no GPU with index {index}")
        return self._gpus[index]

    def _gi(self, op: str, gpu: _Gpu, gi_id: int) -> _Gi:
        gi = gpu.gis.get(gi_id)
        if gi is None:
            raise NvmlError(NvmlErrorCode.NOT_FOUND, op, f"GPU {gpu.index} has no GI {gi_id}")
        return gi

    # -- the port ----------------------------------------------------------------------

    def gpus(self, *, isolate: bool = False) -> list[GpuInfo]:
        self._enter("gpus")
        out = [self._entry(g, isolate) for g in self._gpus]
        self._leave("gpus")
        return out

    def _entry(self, g: _Gpu, isolate: bool) -> GpuInfo:
        """GPU ``g``'s entry in ``gpus()``; a fault scoped to it fails it alone."""
        if self.faults:
            try:
                self._maybe_fail("gpus", False, (g.index,), scoped=True)
            except NvmlError as e:
                if not isolate:
                    raise
                return GpuInfo.unreadable(g.index, e)
        return GpuInfo(
            index=g.index,
            uuid=g.uuid,
            name=f"NVIDIA {g.model.name}",
            pci_device_id=g.model.pci_device_ids[0] if g.model.pci_device_ids else "",
            memory_mib=g.model.memory_mib,
            mig_enabled=g.mig_enabled,
            mig_capable=g.model.mig_capable,
            compute_mode=g.compute_mode,
            pending_mig_enabled=g.mig_pending_mode,
            pci_bus_id=g.bus_id,
        )

    def set_mig_mode(self, gpu: int, enabled: bool) -> NvmlErrorCode | None:
        op = "set_mig_mode"
        self._enter(op, gpu, int(enabled))
        g = self._gpu(op, gpu)
        if not g.model.mig_capable:
            raise NvmlError(NvmlErrorCode.NOT_SUPPORTED, op, f"{g.model.name} has no MIG")
        status: NvmlErrorCode | None = None
        busy = any(p.gpu == g.index for p in self._procs.values())
        if g.mig_enabled == enabled:
            g.mig_pending_mode = enabled  # cancels a pending change
        elif g.gis:
            raise NvmlError(NvmlErrorCode.IN_USE, op, f"GPU {g.index} has GPU instances")
        elif g.activation is MigActivation.IMMEDIATE:
            if busy:  # nothing changes: idle the GPU and ask again
                status = NvmlErrorCode.IN_USE
            else:
                g.mig_enabled = g.mig_pending_mode = enabled
        else:  # Ampere: the driver resets the GPU to activate the change
            g.mig_pending_mode = enabled
            if self.passthrough:
                status = NvmlErrorCode.RESET_REQUIRED
            elif busy or g.persistence:
                status = NvmlErrorCode.IN_USE  # left pending until a reset
            else:
                g.mig_enabled = enabled
        self._leave(op)
        return status

    def reset_gpu(self, gpu: int) -> None:
        op = "reset_gpu"
        self._enter(op, gpu)
        g = self._gpu(op, gpu)
        reset_gpu(NvidiaSmi(self.nvidia_smi), g.bus_id, g.persistence)
        self._leave(op)

    def nvidia_smi(
        self, argv: Sequence[str], env: Mapping[str, str], stdin: str | None
    ) -> tuple[int, str]:
        """The host driver's ``nvidia-smi`` on these GPUs: ``-r -i BUS`` and ``-pm 0|1 -i BUS``
        (a :data:`node_agent.runner.Runner`; exit codes and messages as the real tool's)."""
        if not self.tool_present:
            return 127, f"cannot run {argv[0]}: [Errno 2] No such file or directory: '{argv[0]}'"
        args = list(argv[1:])
        if len(args) < 3 or args[-2] != "-i":
            return 2, "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help."
        g = next((x for x in self._gpus if x.bus_id.lower() == args[-1].lower()), None)
        if g is None:
            return 6, f"No devices were found matching {args[-1]}"
        if args[:-2] == ["-pm", "0"] or args[:-2] == ["-pm", "1"]:
            g.persistence = args[1] == "1"
            state = "Enabled" if g.persistence else "Disabled"
            return 0, f"Persistence mode set to {state} for GPU {g.bus_id}.\nAll done."
        if args[:-2] != ["-r"]:
            return 2, "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help."
        if g.gis or g.persistence or any(p.gpu == g.index for p in self._procs.values()):
            return 255, (
                f"The following GPUs could not be reset:\n  GPU {g.bus_id}: In use by another "
                "client\n\n1 device is currently being used by one or more other processes "
                "(e.g., Fabric Manager, CUDA application, graphics application such as an X "
                "server, or a monitoring application such as another instance of nvidia-smi). "
                "Please first kill all processes using this device and all compute applications "
                "running in the system."
            )
        g.mig_enabled = g.mig_pending_mode
        return 0, f"GPU {g.bus_id} was successfully reset.\nAll done."

    def set_compute_mode(self, gpu: int, mode: ComputeMode) -> None:
        op = "set_compute_mode"
        self._enter(op, gpu, int(mode))
        g = self._gpu(op, gpu)
        exclusive = (ComputeMode.EXCLUSIVE_PROCESS, ComputeMode.EXCLUSIVE_THREAD)
        if g.mig_enabled and ComputeMode(mode) in exclusive:
            raise NvmlError(
                NvmlErrorCode.NOT_SUPPORTED, op, f"GPU {gpu} has MIG mode on: compute mode stays"
            )
        g.compute_mode = ComputeMode(mode)
        self._leave(op)

    def gpu_instances(self, gpu: int) -> list[GpuInstanceInfo]:
        return [gi for gi, _ in self.gpu_instances_with_ci_slices(gpu)]

    def gpu_instances_with_ci_slices(
        self, gpu: int
    ) -> list[tuple[GpuInstanceInfo, dict[int, int]]]:
        """Every GI, with the compute slices of each of its CIs (CI id -> slices); one
        ``gpu_instances`` call for hooks and faults."""
        op = "gpu_instances"
        self._enter(op, gpu)
        g = self._gpu(op, gpu)
        if not g.mig_enabled:
            raise NvmlError(NvmlErrorCode.NOT_SUPPORTED, op, f"MIG mode is off on GPU {gpu}")
        out = [
            (
                GpuInstanceInfo(
                    gpu, gi.gi_id, gi.profile.profile_id, gi.start, gi.profile.memory_slices,
                    tuple(sorted(gi.cis)),
                ),
                {ci: gi.slices_of(ci) for ci in sorted(gi.cis)},
            )
            for gi in sorted(g.gis.values(), key=lambda x: x.gi_id)
        ]  # fmt: skip
        self._leave(op)
        return out

    def create_gpu_instance(self, gpu: int, profile_id: int, start: int, size: int) -> int:
        op = "create_gpu_instance"
        self._enter(op, gpu, profile_id, start, size)
        g = self._gpu(op, gpu)
        if not g.model.mig_capable or not g.mig_enabled:
            raise NvmlError(NvmlErrorCode.NOT_SUPPORTED, op, f"MIG mode is off on GPU {gpu}")
        prof = next((p for p in g.model.profiles if p.profile_id == profile_id), None)
        if prof is None:
            raise NvmlError(NvmlErrorCode.INVALID_ARGUMENT, op, f"unknown profile id {profile_id}")
        if size != prof.memory_slices or start not in prof.starts:
            raise NvmlError(
                NvmlErrorCode.INVALID_ARGUMENT,
                op,
                f"placement ({start}, {size}) is not a placement of {prof.name}",
            )
        taken = {
            s for gi in g.gis.values() for s in range(gi.start, gi.start + gi.profile.memory_slices)
        }
        reason = ""
        if any(s in taken for s in range(start, start + size)):
            reason = "memory slots taken"
        elif sum(1 for gi in g.gis.values() if gi.profile == prof) >= prof.max_count:
            reason = f"{prof.name} at its maximum of {prof.max_count}"
        elif prof.has_media_extensions and any(
            gi.profile.has_media_extensions for gi in g.gis.values()
        ):
            reason = "a +me instance exists"
        elif "+me.all" in (
            variants := [*(gi.profile.variant for gi in g.gis.values()), prof.variant]
        ) and any(v not in ("+me.all", "-me") for v in variants):
            reason = "+me.all allows only -me profiles beside it"
        elif sum(gi.profile.compute for gi in g.gis.values()) + prof.compute > (
            g.model.compute_slices
        ):
            reason = "compute slices exhausted"
        if reason:
            raise NvmlError(NvmlErrorCode.INSUFFICIENT_RESOURCES, op, reason)
        gi_id = next(i for i in range(1, len(g.gis) + 2) if i not in g.gis)
        g.gis[gi_id] = _Gi(gi_id, prof, start)
        self._leave(op)
        return gi_id

    def create_compute_instance(self, gpu: int, gi_id: int, *, slices: int | None = None) -> int:
        """The full-size CI of a GI (the port); ``slices``: a CI of that many compute slices
        instead (what an admin's ``nvidia-smi mig -cci`` makes; not the port's)."""
        op = "create_compute_instance"
        self._enter(op, gpu, gi_id)
        gi = self._gi(op, self._gpu(op, gpu), gi_id)
        size = gi.profile.compute if slices is None else slices
        if size not in CI_PROFILE_SLICES or size > gi.profile.compute:
            raise NvmlError(
                NvmlErrorCode.NOT_SUPPORTED,
                op,
                f"{gi.profile.name} has no compute-instance profile of {size} slice(s)",
            )
        taken = sum(gi.slices_of(ci) for ci in gi.cis)
        if taken + size > gi.profile.compute:
            raise NvmlError(
                NvmlErrorCode.INSUFFICIENT_RESOURCES,
                op,
                f"GI {gi_id} has {gi.profile.compute - taken} of its {gi.profile.compute} compute "
                f"slice(s) free, not {size}",
            )
        ci_id = next(i for i in range(len(gi.cis) + 1) if i not in gi.cis)
        gi.cis[ci_id] = self._uuid("MIG")
        gi.ci_slices[ci_id] = size
        self._leave(op)
        return ci_id

    def destroy_compute_instance(self, gpu: int, gi_id: int, ci_id: int) -> None:
        op = "destroy_compute_instance"
        self._enter(op, gpu, gi_id, ci_id)
        gi = self._gi(op, self._gpu(op, gpu), gi_id)
        if ci_id not in gi.cis:
            raise NvmlError(NvmlErrorCode.NOT_FOUND, op, f"GI {gi_id} has no CI {ci_id}")
        if any((p.gpu, p.gi_id, p.ci_id) == (gpu, gi_id, ci_id) for p in self._procs.values()):
            raise NvmlError(NvmlErrorCode.IN_USE, op, f"processes run on GI {gi_id} CI {ci_id}")
        del gi.cis[ci_id]
        gi.ci_slices.pop(ci_id, None)
        self._leave(op)

    def destroy_gpu_instance(self, gpu: int, gi_id: int) -> None:
        op = "destroy_gpu_instance"
        self._enter(op, gpu, gi_id)
        g = self._gpu(op, gpu)
        gi = self._gi(op, g, gi_id)
        if gi.cis:
            raise NvmlError(NvmlErrorCode.IN_USE, op, f"GI {gi_id} still has compute instances")
        del g.gis[gi_id]
        self._leave(op)

    def mig_devices(self, gpu: int) -> list[MigDevice]:
        op = "mig_devices"
        self._enter(op, gpu)
        g = self._gpu(op, gpu)
        out = [
            MigDevice(gpu, gi.gi_id, ci, u)
            for gi in sorted(g.gis.values(), key=lambda x: x.gi_id)
            for ci, u in sorted(gi.cis.items())
        ]
        self._leave(op)
        return out

    def running_processes(self, gpu: int, gi_id: int | None = None) -> list[int]:
        op = "running_processes"
        self._enter(op, gpu, -1 if gi_id is None else gi_id)
        self._gpu(op, gpu)
        out = sorted(
            pid
            for pid, p in self._procs.items()
            if p.gpu == gpu and (gi_id is None or p.gi_id == gi_id)
        )
        self._leave(op)
        return out

    def process_name(self, pid: int) -> str:
        p = self._procs.get(pid)
        return p.name if p is not None else ""

    # -- XID events (see the module docstring) -----------------------------------------

    def watch_xids(self) -> XidRegistration:
        """Register every GPU but those in :attr:`xid_unsupported` (a fresh event set)."""
        gpus = [g.index for g in self._gpus]
        unsupported = tuple(i for i in gpus if i in self.xid_unsupported)
        registered = tuple(i for i in gpus if i not in self.xid_unsupported)
        with self._xid_ready:
            self._xid_watched = frozenset(registered)
            self._xid_queue.clear()
        return XidRegistration(registered, unsupported)

    def xid_events(self, timeout_ms: int) -> list[XidEvent]:
        with self._xid_ready:
            self._xid_ready.wait_for(lambda: bool(self._xid_queue), max(0, timeout_ms) / 1000)
            out, self._xid_queue = self._xid_queue, []
        return out

    def emit_xid(self, gpu: int, code: int, gi: int | None = None, ci: int | None = None) -> bool:
        """The driver reports XID ``code`` on ``gpu`` (on MIG instance ``gi``/``ci`` if given);
        ``False``: the GPU is not registered and the event is lost, as in NVML."""
        with self._xid_ready:
            if gpu not in self._xid_watched:
                return False
            self._xid_queue.append(XidEvent(gpu, code, gi, ci))
            self._xid_ready.notify_all()
        return True

    # -- test controls (not part of the port; never fault-injected) --------------------

    def model_of(self, gpu: int) -> GpuModel:
        return self._gpu("model_of", gpu).model

    def start_process(
        self, gpu: int, gi_id: int | None = None, ci_id: int | None = None, name: str = "cuda-app"
    ) -> int:
        """Start a process on a MIG device (or, with MIG off, on the whole GPU); return its pid."""
        g = self._gpu("start_process", gpu)
        if gi_id is None:
            if g.mig_enabled:
                raise NvmlError(NvmlErrorCode.INVALID_STATE, "start_process", "MIG is on")
        else:
            gi = self._gi("start_process", g, gi_id)
            if ci_id not in gi.cis:
                raise NvmlError(NvmlErrorCode.NOT_FOUND, "start_process", f"no CI {ci_id}")
        self._next_pid += 1
        self._procs[self._next_pid] = _Proc(gpu, gi_id, ci_id, name)
        return self._next_pid

    def stop_process(self, pid: int) -> None:
        self._procs.pop(pid, None)

    def process_count(self) -> int:
        return len(self._procs)

    def reboot(self) -> None:
        """A node reboot / driver reload: instances and processes are gone; a pending MIG mode
        is applied and persists on Ampere, MIG mode goes back to disabled on Hopper+."""
        self._procs.clear()
        for g in self._gpus:
            g.gis.clear()
            g.compute_mode = ComputeMode.DEFAULT
            if g.activation is MigActivation.IMMEDIATE:
                g.mig_pending_mode = False
            g.mig_enabled = g.mig_pending_mode

    def uuid_of(self, gpu: int, gi_id: int, ci_id: int = 0) -> str:
        return self._gi("uuid_of", self._gpu("uuid_of", gpu), gi_id).cis[ci_id]

    def mig_uuids(self) -> dict[str, tuple[int, int, int]]:
        """Every MIG device UUID -> ``(gpu, GI id, CI id)``."""
        return {
            u: (g.index, gi.gi_id, ci)
            for g in self._gpus
            for gi in g.gis.values()
            for ci, u in gi.cis.items()
        }

    def gpu_index_of(self, gpu_uuid: str) -> int:
        for g in self._gpus:
            if g.uuid == gpu_uuid:
                return g.index
        raise KeyError(gpu_uuid)

    def layout(self, gpu: int) -> list[tuple[MigProfile, int, bool]]:
        """``(profile, start, has a CI)`` of every GI on ``gpu``, by start."""
        g = self._gpu("layout", gpu)
        return sorted(
            ((gi.profile, gi.start, bool(gi.cis)) for gi in g.gis.values()), key=lambda t: t[1]
        )

    def mig_enabled(self, gpu: int) -> bool:
        return self._gpu("mig_enabled", gpu).mig_enabled

    def mig_pending(self, gpu: int) -> bool:
        """A MIG-mode change waits for a GPU reset (Ampere)."""
        g = self._gpu("mig_pending", gpu)
        return g.mig_pending_mode != g.mig_enabled

    def processes_on(self, gpu: int, gi_id: int | None = None) -> int:
        return sum(
            1 for p in self._procs.values() if p.gpu == gpu and (gi_id is None or p.gi_id == gi_id)
        )

    def instances(self, gpu: int) -> list[tuple[int, MigProfile, int, tuple[str, ...]]]:
        """``(GI id, profile, start, MIG UUIDs)`` of every GI on ``gpu``."""
        g = self._gpu("instances", gpu)
        return [
            (gi.gi_id, gi.profile, gi.start, tuple(gi.cis.values()))
            for gi in sorted(g.gis.values(), key=lambda x: x.start)
        ]

    def compute_mode(self, gpu: int) -> ComputeMode:
        return self._gpu("compute_mode", gpu).compute_mode

    def set_persistence_mode(self, gpu: int, enabled: bool) -> None:
        """Persistence mode as the driver (or nvidia-persistenced) set it at boot."""
        self._gpu("set_persistence_mode", gpu).persistence = enabled

    def persistence_mode(self, gpu: int) -> bool:
        return self._gpu("persistence_mode", gpu).persistence

    def gpu_uuid(self, gpu: int) -> str:
        return self._gpu("gpu_uuid", gpu).uuid

    def mig_uuids_of(self, gpu: int) -> dict[tuple[int, int], str]:
        """``(GI id, CI id)`` -> MIG UUID on one GPU."""
        g = self._gpu("mig_uuids_of", gpu)
        return {(gi.gi_id, ci): u for gi in g.gis.values() for ci, u in gi.cis.items()}
