"""The reconciler: make one node's GPUs match its NodePartitioning spec, safely and idempotently.

Model
-----
A pass (:meth:`Reconciler.reconcile`) is a pure function of what it reads, not of its memory:

1. **read** the kubelet's in-use device ids (``None`` if unreadable) and the hardware (NVML:
   GPUs, GPU/compute instances, MIG UUIDs, processes) into :class:`~node_agent.gpu_plan.ObservedGpu`.
2. **plan** every GPU the spec lists with :func:`node_agent.gpu_plan.plan_gpu`: validate the
   whole target first, protect every used instance/slice, then diff.  A GPU the spec cannot be
   applied to gets a Block (Degraded, or transient) and no operation.
3. **withdraw**: if anything is to be destroyed, first re-advertise the devices *without* the
   doomed ones (so the kubelet cannot hand them out any more), then re-read the in-use ids; a
   doomed device that was allocated in between cancels its GPU's plan for this pass.
4. **execute** per GPU, in this order: re-check processes, destroy CI then GI of each free
   unwanted instance, switch MIG mode (the GPU is idle by then), create the missing CIs, create
   the wanted GIs at their exact placements (largest first) each followed by its CI, store the
   new MPS slice table.  The first NVML error stops that GPU for this pass; other GPUs go on.
   ``set_mig_mode`` succeeds with an *activation status* (nvml.h): none, the mode is current;
   ``RESET_REQUIRED`` (pass-through VM), it is pending; any other (``IN_USE``: the GPU was not
   idle) is judged by reading the mode back -- pending (Ampere) goes on as below, not recorded
   (Hopper) is an error and the switch is asked for again next pass
   (:func:`mig_activation`).
   A MIG-mode change the driver leaves *pending* (Ampere) is activated right away by resetting
   the GPU through the port (the host driver's ``nvidia-smi -r``, :mod:`node_agent.gpu_reset`)
   if it is still idle.  Processes on the GPU, or a reset that needs the operator (no
   ``nvidia-smi``, the GPU held by another client, no permission), make the GPU Degraded with
   reason ``MIGModePending`` naming the processes or the remedy; each pass tries the reset
   again (the request itself is not repeated), and the status is never ``Applied`` while a
   change is pending.
5. **MPS daemons**: one per GPU with MPS slices, one per MIG instance on hybrid GPUs; daemons no
   longer wanted are stopped (never one whose slices or instance are in use: those are wanted).
   A wanted daemon that died is started again like any missing one, in use or not (its clients
   died with it); its devices are Unhealthy while it cannot be started, or while its limits
   are not all sent (limits-pending, retried every pass: node_agent.mps).
   A hybrid instance that hosts MPS slices (``spec.gpus[].mig[].mps``) is advertised as its
   slices, not as a MIG device; its daemon gets its largest slice as limits, and the daemon of
   an instance without slices 100 % and the instance's memory (a host made a whole instance
   keeps its daemon, whose old pinned limit would otherwise cap the pod).  The slice table
   of an instance created in this pass is filled as soon as its UUID is read (same pass).
   A GPU's daemon gets its largest slice's memory and thread % as daemon-side limits, which no
   client can raise; a hybrid daemon whose slot now holds another instance is restarted for it.
   Before a whole-GPU daemon starts, the GPU is put in compute mode ``EXCLUSIVE_PROCESS`` -- only
   while no process runs on it; otherwise the daemon waits (error, slices Unhealthy).  A GPU
   that goes back to MIG gets compute mode ``DEFAULT`` again, just before MIG mode is enabled.
6. **re-read** the hardware, build the status (:func:`node_agent.status.build_status`) and the
   advertised devices (:func:`node_agent.devices.advertised_devices`) and publish them.  A
   GPU instance with several compute instances (made outside gpuslice: *split*,
   :mod:`node_agent.gpu_plan`) is not advertised; a pod holding any of its MIG devices makes
   it used.  So is a GPU instance whose one compute instance is smaller than it
   (:class:`PartialInstance`: a ``1c.3g.40gb`` made by ``nvidia-smi mig -cci`` or a mig-parted
   config; NVIDIA names no resource after it): it is handled exactly as a split one -- never
   advertised (it is not the ``3g.40gb`` its GI's profile names: a pod would get a third of
   it), never a match for a spec entry, destroyed once free (and re-created whole if the spec
   wants its placement), and while used it blocks its GPU (``InstanceInUse``, naming it).  The
   CIs' sizes come from the NVML adapter's ``gpu_instances_with_ci_slices``
   (:func:`instances_with_ci_slices`).

**An unreadable GPU** (an NVML error reading one GPU: its handle, MIG mode, instances, MIG
devices or processes -- ``GPU_IS_LOST`` typically) is isolated for the pass: it is not planned,
nothing on it is created, destroyed or switched, and no MPS daemon of it is stopped.  Its
devices stay advertised, from the last state read (this agent's, else ``previous`` status),
but Unhealthy, so the kubelet stops allocating them while pods holding them keep them; the
status keeps that state in ``status.gpus`` and a ``Degraded`` block ``GpuUnreadable`` names
the GPU and the error.  The other GPUs are reconciled and published as usual.  Once the GPU
reads again its devices are Healthy and it is reconciled like the others.  NVML itself down
(the device count unreadable, or a driver-wide code such as ``UNINITIALIZED`` or
``DRIVER_NOT_LOADED`` on any read) still fails the whole pass: nothing is published.

**An XID critical error** (:mod:`node_agent.xid`): the events the agent's watcher put in the
:class:`~node_agent.xid.XidLedger` are resolved at the next pass into marks -- the MIG device
of the GPU instance an event names, else the whole GPU -- that this reconciler keeps for its
lifetime (an event that came in before a pass had made its changes and names a GPU
instance id that pass destroyed or created marks the whole GPU: the driver reuses GI ids, so
the event may be about the old instance or the new one).  Every pass (the withdrawal publish
included) advertises the marked devices Unhealthy, and the status gets a ``Degraded`` block
``GpuXid`` per marked GPU naming the instance and the XID (a GPU that also has another
permanent block keeps that reason, with the XID added to its message).  The marks change
nothing else: the GPU is planned and reconciled as before, no instance or daemon is created,
destroyed or restarted because of them.

**Drain** (no NodePartitioning: the node opted out and the partitioner deleted it, gpuslice is
being uninstalled, or the partitioner has not created it yet).  A pass without a spec changes no
MIG layout and destroys nothing.  It advertises only the devices pods hold (in-use ids read this
pass; none known: nothing is published), so the kubelet can hand out no free slice; it keeps
the MPS daemons those pods use and stops the others once a fresh in-use read shows no client;
and a whole GPU whose daemon is gone and that runs no process is put back in compute mode
``DEFAULT`` (gpuslice set ``EXCLUSIVE_PROCESS`` for MPS).  MIG mode and MIG instances stay as
they are.  :attr:`ReconcileResult.held` lists what pods still hold; the drain is complete when
it is empty.

Crash safety: the only state kept between passes is the MPS slice table (with the lost hosts
below, and, for an unreadable GPU, the last state read of each GPU), and an agent that
restarts rebuilds the in-use part of it from the kubelet's ids (MPS slice ids are
self-describing); free slices are simply re-created.  A hybrid host none of whose slices a pod
holds is rebuilt with an empty table, which would make it look like a whole MIG device: an
instance rebuilt empty that the spec lists with slices -- or, not in the spec, that the
previous status reports with slices or (not in it either) whose MPS daemon runs -- is a *lost
host* and is not advertised at all (its status lists no slice) until the plan has filled its
table (withdrawal first, as for any host made) or destroyed it; only a spec listing it
without slices, or a pod holding it as a whole device, makes it one.  MPS daemons still
running from before the restart are found on the first pass
(:meth:`~node_agent.mps.ProcessSupervisor.discover` probes each GPU's and each MIG instance's
pipe directory), taken over as they are and given their limits again -- never restarted -- so
their clients keep their MPS server.  Every NVML
step leaves a state the next pass understands: a GI without CI is completed or destroyed, a
half-destroyed instance is destroyed, MIG mode already switched is seen as such.  Nothing in
use is ever destroyed because destroys are limited to free unwanted instances, re-checked
(in-use ids after withdrawal, processes just before), and the driver refuses busy instances
anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from contract.nodepartitioning import ActualGpu, NodePartitioningSpec, NodePartitioningStatus
from node_agent.devices import (
    AdvertisedDevice,
    InUseSource,
    advertised_devices,
    mps_pipe_directory,
    parse_mps_slice_id,
)
from node_agent.gpu_plan import (
    Block,
    GpuPlan,
    MpsSlot,
    ObservedGpu,
    ObservedInstance,
    diff_slices,
    plan_gpu,
)
from node_agent.mps import MpsDaemonSpec, MpsError, ProcessSupervisor
from node_agent.nvml import (
    ComputeMode,
    GpuInfo,
    GpuInstanceInfo,
    Nvml,
    NvmlError,
    NvmlErrorCode,
    XidEvent,
)
from node_agent.status import actual_gpus, build_status, flag_unhealthy
from node_agent.xid import XidLedger, XidMark, add_xid_blocks, device_ids, resolve, unhealthy_ids
from planner.catalog import Catalog, CatalogError, GpuModel

__all__ = [
    "NVML_DOWN",
    "PartialInstance",
    "Publish",
    "ReconcileResult",
    "Reconciler",
    "instances_with_ci_slices",
    "mig_activation",
    "unreadable_block",
    "workload",
]

Publish = Callable[[Mapping[str, list[AdvertisedDevice]]], None]
"""Receives resource name -> devices (``DevicePluginManager.set_devices``)."""


@dataclass(frozen=True, slots=True)
class PartialInstance(ObservedInstance):
    """A GPU instance whose one compute instance has fewer compute slices than it (module
    docstring, step 6): handled as :attr:`~node_agent.gpu_plan.ObservedInstance.split`."""

    ci_slices: int = 0
    """The compute slices of its compute instance (fewer than its profile's)."""

    @property
    def split(self) -> bool:
        return True

    def __str__(self) -> str:
        # NVIDIA's name of such a MIG device: <c>c.<g>g.<gb>gb
        uuids = ", ".join(u for u in (self.uuid, *self.other_uuids) if u)
        return f"{self.ci_slices}c.{self.name}@{self.start}" + (f" ({uuids})" if uuids else "")


_SPLIT_WORDS = "have several compute instances (made outside gpuslice, which uses one per instance)"
_PARTIAL_WORDS = (
    "have several compute instances or one smaller than the instance (made outside gpuslice, "
    "which uses one full-size compute instance per instance)"
)
"""How the ``InstanceInUse`` block of :func:`~node_agent.gpu_plan.plan_gpu` words split
instances, and how it is worded when a :class:`PartialInstance` is among them."""


def instances_with_ci_slices(nv: Nvml, gpu: int) -> list[tuple[GpuInstanceInfo, Mapping[int, int]]]:
    """Every GPU instance of ``gpu`` with the compute slices of each of its compute instances
    (CI id -> slices), from the adapter's ``gpu_instances_with_ci_slices`` (both adapters and
    :class:`~node_agent.metrics.MeteredNvml` have it); an :class:`~node_agent.nvml.Nvml`
    without it (a test double) gives ``gpu_instances`` with the sizes unknown (``{}``: each CI
    taken as full-size)."""
    detailed: Any = getattr(nv, "gpu_instances_with_ci_slices", None)
    if detailed is not None:
        return list(detailed(gpu))
    return [(gi, {}) for gi in nv.gpu_instances(gpu)]


@dataclass(frozen=True)
class ReconcileResult:
    status: NodePartitioningStatus
    devices: dict[str, list[AdvertisedDevice]]
    applied: bool
    """Every GPU of the spec matches it; nothing blocked; no error this pass."""
    blocks: dict[int, Block] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    operations: int = 0
    """Mutating NVML calls made this pass."""
    fresh: bool = True
    """``devices`` lists every device of the node (but lost hosts: module docstring), read
    this pass (else nothing was published: NVML unreadable, or an MPS slice table unknown
    after a restart)."""
    draining: bool = False
    """The pass ran without a spec (no NodePartitioning): see "Drain" in the module docstring."""
    held: tuple[str, ...] = ()
    """While draining: the device ids pods hold, the only ones still advertised (sorted)."""
    nvml_failed: bool = False
    """NVML could not be read at all this pass (the only reported error that fails liveness:
    :mod:`node_agent.agent`)."""

    @property
    def degraded(self) -> bool:
        return any(not b.transient for b in self.blocks.values())

    @property
    def settled(self) -> bool:
        """Nothing more a retry could do: applied, or every remaining block is permanent."""
        if self.errors:
            return False
        return self.applied or (
            bool(self.blocks) and all(not b.transient for b in self.blocks.values())
        )


def mig_activation(nvml: Nvml, g: int, enabled: bool, status: NvmlErrorCode | None) -> bool | None:
    """What ``set_mig_mode`` left on GPU ``g``, given its activation status ``status``:
    ``False`` the mode is current, ``True`` it is pending a GPU reset, ``None`` neither (the
    caller asks again later).  Both agents use it.

    ``None`` (``NVML_SUCCESS``) is current; ``RESET_REQUIRED`` (a pass-through VM) is pending.
    Any other status (nvml.h: ``IN_USE`` when the driver could not unbind or reset a busy GPU,
    "idle the device and retry") is judged by reading the mode back: a change the driver left
    pending (Ampere) is activated by the reset, one it did not record (Hopper: a process came
    between the idle check and the switch) is asked for again later -- resetting a GPU whose
    mode is not pending would only make the creates that follow fail."""
    if status is None:
        return False
    if status == NvmlErrorCode.RESET_REQUIRED:
        return True
    info = next((x for x in nvml.gpus(isolate=True) if x.index == g), None)
    if info is not None and info.read_error is None:
        if info.mig_pending and info.mig_target == enabled:
            return True
        if not info.mig_pending and info.mig_enabled == enabled:
            return False
    return None


class Reconciler:
    """Applies NodePartitioning specs to one node (see the module docstring)."""

    def __init__(
        self,
        nvml: Nvml,
        in_use: InUseSource,
        supervisor: ProcessSupervisor,
        catalog: Catalog,
        *,
        mps_pipe_root: str = "/run/nvidia/mps",
        mps_log_root: str = "/var/log/nvidia-mps",
        publish: Publish | None = None,
        xids: XidLedger | None = None,
    ) -> None:
        self._nvml = nvml
        self._in_use = in_use
        self._supervisor = supervisor
        self._catalog = catalog
        self._pipe_root = mps_pipe_root
        self._log_root = mps_log_root.rstrip("/")
        self._publish = publish
        self._slices: dict[str, tuple[MpsSlot, ...]] = {}
        """GPU UUID -> MPS slice table (rebuilt from in-use ids after a restart); also MIG
        device UUID -> the table of the slices a hybrid instance hosts."""
        self._rebuilt: set[str] = set()
        """MIG UUIDs whose table the first read of this pass rebuilt empty (not yet sorted out
        by :meth:`_sort_rebuilt`)."""
        self._lost_hosts: set[str] = set()
        """MIG UUIDs of probable hosts whose free slices a restart lost (their table rebuilt
        empty): never advertised as whole MIG devices (module docstring, "Crash safety")."""
        self._models: dict[str, GpuModel | None] = {}
        self._known: dict[int, ActualGpu] = {}
        """GPU index -> its state when last read (advertised Unhealthy while unreadable)."""
        self._discovered = False
        """Daemons left running by an earlier agent were looked for (first readable pass)."""
        self._xids = xids
        self._xid_marks: list[XidMark] = []
        """Devices XID critical errors hit: Unhealthy for this reconciler's lifetime."""
        self._xid_later: list[XidEvent] = []
        """XID events of a GPU not read yet (resolved at a later pass)."""
        self._gi_changed: dict[int, set[int]] = {}
        """GPU index -> GI ids destroyed or created since the XID events were last taken (an
        event that came in meanwhile naming one may be about the old instance or the new one:
        the whole GPU is marked)."""
        self._changed_before = 0
        """The ledger's count of XID events when the last pass that changed GIs had made its
        changes: the events numbered below it may predate those changes."""

    @property
    def xid_marks(self) -> tuple[XidMark, ...]:
        """The devices XID critical errors hit (module docstring)."""
        return tuple(self._xid_marks)

    @property
    def supervisor(self) -> ProcessSupervisor:
        """The MPS daemons' supervisor (the agent checks their liveness between passes)."""
        return self._supervisor

    # -- reading -----------------------------------------------------------------------

    async def _read_in_use(self, errors: list[str]) -> set[str] | None:
        try:
            return set(await self._in_use.in_use_device_ids())
        except Exception as e:  # any failure means "unknown": destroy nothing
            errors.append(f"kubelet PodResources unavailable: {e}")
            return None

    def _model(self, info: GpuInfo) -> GpuModel | None:
        key = f"{info.pci_device_id}|{info.name}"
        if key not in self._models:
            self._models[key] = self._catalog.model_for_device(info.pci_device_id, info.name)
        return self._models[key]

    def _observe(self, in_use: set[str] | None) -> tuple[list[ObservedGpu], dict[int, NvmlError]]:
        """The readable GPUs, and the error of each GPU that could not be read (isolated).

        Raises :class:`NvmlError` when NVML itself is down (the device count unreadable, or a
        driver-wide error code on any GPU's read)."""
        out: list[ObservedGpu] = []
        failed: dict[int, NvmlError] = {}
        for info in self._nvml.gpus(isolate=True):
            try:
                if info.read_error is not None:
                    raise info.read_error
                out.append(self._observe_gpu(info, in_use))
            except NvmlError as e:
                if e.code in NVML_DOWN:
                    raise
                failed[info.index] = e
        return out, failed

    def _observe_gpu(self, info: GpuInfo, in_use: set[str] | None) -> ObservedGpu:
        nv = self._nvml
        model = self._model(info)
        i = info.index
        instances: list[ObservedInstance] = []
        gpu_procs = 0
        if info.mig_enabled:
            uuids: dict[int, list[str]] = {}
            for d in nv.mig_devices(i):
                uuids.setdefault(d.gi_id, []).append(d.uuid)
            for gi, ci_slices in instances_with_ci_slices(nv, i):
                profile = None
                if model is not None:
                    try:
                        profile = model.profile_by_id(gi.profile_id)
                    except CatalogError:
                        profile = None
                # one CI smaller than the GI: not the MIG device its profile names
                partial = 0
                if profile is not None and len(gi.compute_instances) == 1:
                    size = ci_slices.get(gi.compute_instances[0])
                    if size is not None and size < profile.compute:
                        partial = size
                uuid, *others = uuids.get(gi.gi_id) or [""]
                busy = bool(gi.compute_instances) and bool(workload(nv, i, gi.gi_id))
                known = uuid in self._slices
                hosted = self._table(uuid, in_use) if uuid else ()
                if uuid and not known and hosted == ():
                    self._rebuilt.add(uuid)
                inst = ObservedInstance(
                    gi_id=gi.gi_id,
                    profile_id=gi.profile_id,
                    profile=profile,
                    start=gi.start,
                    size=gi.size,
                    ci_ids=gi.compute_instances,
                    uuid=uuid,
                    in_use=in_use is None or any(u in in_use for u in (uuid, *others) if u),
                    busy=busy,
                    slices=hosted,
                    used_slices=_used(hosted, in_use),
                    other_uuids=tuple(others),
                )
                if partial:
                    inst = PartialInstance(**_fields(inst), ci_slices=partial)
                instances.append(inst)
            slices: tuple[MpsSlot, ...] | None = ()
        else:
            gpu_procs = len(workload(nv, i))
            slices = self._table(info.uuid, in_use)
        return ObservedGpu(
            info=info,
            model=model,
            instances=tuple(instances),
            gpu_processes=gpu_procs,
            slices=slices,
            used_slices=_used(slices, in_use),
            in_use_known=in_use is not None,
        )

    def _table(self, uuid: str, in_use: set[str] | None) -> tuple[MpsSlot, ...] | None:
        """The MPS slice table of a GPU or (hybrid) MIG device, by its UUID; after a restart
        rebuilt from the in-use ids (``None`` while they are unreadable)."""
        table = self._slices.get(uuid)
        if table is not None:
            return table
        if in_use is None:
            return None
        rebuilt: list[MpsSlot] = []
        for dev in sorted(in_use):
            sid = parse_mps_slice_id(dev)
            if sid is not None and sid.gpu_uuid == uuid:
                rebuilt.append(MpsSlot(sid.slot, sid.memory_mib, sid.thread_percentage, dev))
        table = tuple(sorted(rebuilt, key=lambda s: s.slot))
        self._slices[uuid] = table
        return table

    def _fill_new_hosts(
        self,
        spec: NodePartitioningSpec | None,
        observed: list[ObservedGpu],
        before: set[str],
        blocks: dict[int, Block],
    ) -> list[ObservedGpu]:
        """Give each hybrid instance created this pass (its UUID not in ``before``) the slices
        the spec lists for it; nothing can be allocated on it yet, so nothing is withdrawn."""
        if spec is None or spec.mode != "hybrid":
            return observed
        wanted: dict[tuple[int, int, str], list[tuple[int, int]]] = {}
        for d in spec.gpus:
            for m in d.mig:
                if m.mps:
                    wanted[(d.index, m.start, m.profile)] = [
                        (s.memoryMiB, s.activeThreadPercentage) for s in m.mps
                    ]
        if not wanted:
            return observed
        out: list[ObservedGpu] = []
        for g in observed:
            i = g.info.index
            instances = list(g.instances)
            for k, inst in enumerate(instances):
                if i in blocks or not inst.uuid or inst.uuid in before or inst.slices:
                    continue
                want = next(
                    (
                        w
                        for (gi, start, name), w in wanted.items()
                        if gi == i
                        and start == inst.start
                        and inst.profile is not None
                        and g.model is not None
                        and _same_profile(g.model, name, inst.profile.profile_id)
                    ),
                    None,
                )
                if want is None:
                    continue
                table, _ = diff_slices((), frozenset(), want, inst.uuid)
                if table is not None:
                    self._slices[inst.uuid] = table
                    self._lost_hosts.discard(inst.uuid)
                    instances[k] = replace(inst, slices=table)
            out.append(replace(g, instances=tuple(instances)))
        return out

    def _sort_rebuilt(
        self,
        spec: NodePartitioningSpec | None,
        observed: list[ObservedGpu],
        in_use: set[str] | None,
        previous: NodePartitioningStatus | None,
    ) -> None:
        """Tell the hosts among the instances whose slice table was rebuilt empty (no pod holds
        one of their slices) from the whole MIG devices; keep :attr:`_lost_hosts` up to date
        (module docstring, "Crash safety").

        An instance a pod holds as a whole MIG device is one; so is an instance the spec lists
        without slices.  One the spec lists with slices is a lost host.  Otherwise a rebuilt
        one is a lost host if the ``previous`` status reports it with slices, or -- not in the
        previous status -- if its MPS daemon runs (found by discovery).  A lost host stays one
        until the agent sets its table (:meth:`_execute`, after the withdrawal) or destroys it,
        the spec lists it without slices, or a pod holds it."""
        candidates = self._rebuilt | self._lost_hosts
        self._rebuilt.clear()
        if not candidates:
            return
        desired = {d.index: d for d in spec.gpus} if spec is not None else {}
        before = {
            m.deviceId: bool(m.mps)
            for g in (previous.gpus if previous is not None else ())
            for m in g.mig
            if m.deviceId
        }
        running: set[str] | None = None
        for g in observed:
            i = g.info.index
            d = desired.get(i)
            for inst in g.instances:
                uuid = inst.uuid
                if uuid not in candidates:
                    continue
                if inst.slices or (in_use is not None and uuid in in_use):
                    self._lost_hosts.discard(uuid)  # a host with held slices; a held device
                    continue
                listed = next(
                    (
                        bool(m.mps)
                        for m in (d.mig if d is not None else ())
                        if m.start == inst.start
                        and g.model is not None
                        and _same_profile(g.model, m.profile, inst.profile_id)
                    ),
                    None,
                )
                if listed is not None:
                    host = listed
                elif uuid in self._lost_hosts:
                    host = True
                elif uuid in before:
                    host = before[uuid]
                else:
                    if running is None:
                        running = self._supervisor.running()
                    host = mps_key(i, inst.start) in running
                if host:
                    self._lost_hosts.add(uuid)
                else:
                    self._lost_hosts.discard(uuid)

    # -- planning ----------------------------------------------------------------------

    @staticmethod
    def _plan(
        spec: NodePartitioningSpec | None,
        observed: list[ObservedGpu],
        unreadable: Mapping[int, NvmlError],
    ) -> tuple[dict[int, GpuPlan], dict[int, Block]]:
        plans: dict[int, GpuPlan] = {}
        blocks = {i: unreadable_block(i, e) for i, e in sorted(unreadable.items())}
        if spec is None:
            return plans, blocks
        by_index = {g.info.index: g for g in observed}
        seen: set[int] = set()
        for d in spec.gpus:
            if d.index in seen:
                blocks[d.index] = Block(
                    "InvalidSpec", f"GPU {d.index}: listed twice in spec.gpus; list it once"
                )
                plans.pop(d.index, None)
                continue
            seen.add(d.index)
            if d.index in unreadable:
                continue  # isolated this pass: its block says why
            obs = by_index.get(d.index)
            if obs is None:
                blocks[d.index] = Block(
                    "NoSuchGpu",
                    f"GPU {d.index}: the node has GPUs {sorted({*by_index, *unreadable})}; "
                    "the spec names a "
                    "GPU index it does not have",
                )
                continue
            plan = plan_gpu(obs, d, spec.mode)
            block = plan.block
            if block is not None:
                if any(isinstance(x, PartialInstance) and x.used for x in obs.instances):
                    block = replace(
                        block, message=block.message.replace(_SPLIT_WORDS, _PARTIAL_WORDS)
                    )
                blocks[d.index] = block
            elif not plan.is_noop():
                plans[d.index] = plan
        return plans, blocks

    @staticmethod
    def _doomed(obs: ObservedGpu, plan: GpuPlan) -> set[str]:
        ids = {u for i in plan.destroy for u in (i.uuid, *i.other_uuids) if u}
        ids |= {s.device_id for i in plan.destroy for s in i.slices or ()}
        if plan.slices is not None and obs.slices:
            keep = {s.device_id for s in plan.slices}
            ids |= {s.device_id for s in obs.slices if s.device_id not in keep}
        tables = dict(plan.hosted)
        for inst in obs.instances:
            new = tables.get(inst.uuid)
            if new is not None:
                keep = {s.device_id for s in new}
                ids |= {s.device_id for s in inst.slices or () if s.device_id not in keep}
                if not inst.slices and new:
                    ids.add(inst.uuid)  # becomes a host: no longer a MIG device
        return ids

    # -- executing ---------------------------------------------------------------------

    def _activate_mig_mode(
        self, obs: ObservedGpu, enabled: bool, blocks: dict[int, Block]
    ) -> tuple[bool, int]:
        """Make a pending MIG mode current by resetting the GPU.  Returns ``(activated, NVML
        mutations made)``.

        The reset needs the GPU idle.  Compute processes on it (a CUDA job started meanwhile)
        are named in a ``MIGModePending`` block and no reset is tried; so is a reset the tool
        refuses or cannot do (``nvidia-smi`` missing, the GPU held by another client such as
        nvidia-persistenced or DCGM, no permission), with the remedy.  Other failures are
        errors, retried next pass.  Every pass tries again while the change is pending (the
        request itself is not repeated), and sees the mode current once the GPU was reset."""
        nv = self._nvml
        g = obs.info.index
        bus = obs.info.pci_bus_id or str(g)
        what = "enable" if enabled else "disable"
        procs = nv.running_processes(g)
        if procs:
            named = ", ".join(f"pid {p} ({nv.process_name(p) or 'unknown'})" for p in procs[:8])
            more = f" and {len(procs) - 8} more" if len(procs) > 8 else ""
            blocks[g] = Block(
                "MIGModePending",
                f"GPU {g}: MIG mode {what} is pending a GPU reset, which these processes "
                f"block: {named}{more}; the agent resets the GPU once they have ended",
            )
            return False, 0
        try:
            nv.reset_gpu(g)
        except NvmlError as e:
            remedy = RESET_REMEDY.get(e.code)
            if remedy is None:
                raise
            blocks[g] = Block(
                "MIGModePending",
                f"GPU {g}: MIG mode {what} is pending and the GPU reset failed ({e}): "
                + remedy.format(gpu=g, bus=bus),
            )
            return False, 0
        return True, 1

    def _mig_activation(
        self, g: int, enabled: bool, status: NvmlErrorCode | None, errors: list[str]
    ) -> bool | None:
        """:func:`mig_activation`; ``None`` records an error (the next pass asks again)."""
        pending = mig_activation(self._nvml, g, enabled, status)
        if pending is None:
            assert status is not None
            what = "enable" if enabled else "disable"
            errors.append(
                f"GPU {g}: MIG mode {what} was not activated (NVML activation status "
                f"{status.name}: the GPU is not idle); asked again next pass"
            )
        return pending

    def _execute(
        self, obs: ObservedGpu, plan: GpuPlan, blocks: dict[int, Block], errors: list[str]
    ) -> int:
        nv = self._nvml
        g = plan.gpu
        ops = 0
        try:
            for inst in plan.destroy:
                if inst.ci_ids and workload(nv, g, inst.gi_id):
                    errors.append(f"GPU {g}: {inst} has processes now; not destroyed")
                    return ops
                # hybrid: the instance's daemon and its idle MPS server hold the instance; a
                # daemon whose quit failed still serves it: MpsError, nothing destroyed
                self._supervisor.stop(mps_key(g, inst.start))
                for ci in inst.ci_ids:
                    nv.destroy_compute_instance(g, inst.gi_id, ci)
                    ops += 1
                self._gi_changed.setdefault(g, set()).add(inst.gi_id)  # the id may be reused
                nv.destroy_gpu_instance(g, inst.gi_id)
                ops += 1
                if inst.uuid:
                    self._slices.pop(inst.uuid, None)
                    self._lost_hosts.discard(inst.uuid)
            if plan.mig_mode is not None:
                if plan.mig_mode:
                    self._supervisor.stop(mps_key(g))
                    if obs.info.compute_mode != ComputeMode.DEFAULT:  # idle: MIG needs it
                        nv.set_compute_mode(g, ComputeMode.DEFAULT)
                        ops += 1
                info = obs.info
                if info.mig_pending and info.mig_target == plan.mig_mode:
                    pending = True  # asked for in an earlier pass: only the reset is missing
                else:
                    status = nv.set_mig_mode(g, plan.mig_mode)
                    ops += 1
                    activation = self._mig_activation(g, plan.mig_mode, status, errors)
                    if activation is None:
                        return ops  # neither current nor pending: asked again next pass
                    pending = activation
                if pending:
                    if plan.mig_mode and plan.slices is not None:
                        # committed to MIG: no MPS slices while the enable waits for a reset
                        self._slices[obs.info.uuid] = plan.slices
                    done, n = self._activate_mig_mode(obs, plan.mig_mode, blocks)
                    ops += n
                    if not done:
                        return ops
            for inst in plan.create_ci:
                nv.create_compute_instance(g, inst.gi_id)
                ops += 1
            for p in sorted(plan.create, key=lambda p: (-p.profile.memory_slices, p.start)):
                gi = nv.create_gpu_instance(
                    g, p.profile.profile_id, p.start, p.profile.memory_slices
                )
                self._gi_changed.setdefault(g, set()).add(gi)
                ops += 1
                nv.create_compute_instance(g, gi)
                ops += 1
            if plan.slices is not None:
                self._slices[obs.info.uuid] = plan.slices
            for uuid, table in plan.hosted:
                self._slices[uuid] = table
                self._lost_hosts.discard(uuid)
        except (NvmlError, MpsError) as e:  # MpsError: a daemon's quit failed (retried)
            errors.append(f"GPU {g}: {e}")
        return ops

    def _sync_daemons(
        self,
        spec: NodePartitioningSpec | None,
        observed: list[ObservedGpu],
        errors: list[str],
        unreadable: Collection[int] = (),
    ) -> tuple[set[str], int, set[str]]:
        """Run the wanted MPS daemons; list the others that no pod seems to use.

        Returns the ids of unhealthy devices, the number of NVML calls made (compute mode) and
        the keys of unwanted daemons to stop once a fresh in-use read confirms they have no
        client (:meth:`_stop_daemons`)."""
        hybrid = _hybrid_gpus(spec)
        wanted: dict[str, MpsDaemonSpec] = {}
        whole_gpu: dict[str, ObservedGpu] = {}
        for g in observed:
            i = g.info.index
            if not g.info.mig_enabled and g.slices:
                if spec is None and not _daemon_in_use(mps_key(i), observed, set()):
                    continue  # draining: only the daemons pods still use
                wanted[mps_key(i)] = self._daemon(mps_key(i), g.info.uuid, i, None, g.slices)
                whole_gpu[mps_key(i)] = g
            for inst in g.instances:
                if not inst.uuid:
                    continue
                k = mps_key(i, inst.start)
                # a host the spec does not make hybrid (the node was relabelled, or the GPU is
                # left out of the spec) keeps its daemon only while its pods use it
                if i in hybrid or (inst.slices and _daemon_in_use(k, observed, set())):
                    whole = inst.profile.memory_mib if inst.profile else g.info.memory_mib
                    wanted[k] = self._daemon(
                        k, inst.uuid, i, inst.start, inst.slices or (), whole_mib=whole
                    )
        running = self._supervisor.running()
        unwanted = {
            k
            for k in running - set(wanted)
            if not _daemon_in_use(k, observed, set()) and _key_gpu(k) not in unreadable
        }  # an unreadable GPU's daemons are left alone: their clients are not known
        # the slices of a host whose daemon is not wanted (a host left out of a hybrid spec
        # keeps its slice table) are advertised Unhealthy, from the publish before it stops
        unhealthy: set[str] = {
            s.device_id
            for g in observed
            for inst in g.instances
            if inst.uuid and inst.slices and mps_key(g.info.index, inst.start) not in wanted
            for s in inst.slices
        }
        ops = 0
        for key, d in sorted(wanted.items()):
            gpu = whole_gpu.get(key)
            if gpu is not None and key not in running:
                try:
                    ops += self._exclusive_process(gpu)
                except (NvmlError, MpsError) as e:
                    errors.append(str(e))
                    unhealthy |= _devices_of_daemon(key, observed)
                    continue
            try:
                self._supervisor.ensure(d)
            except MpsError as e:
                errors.append(str(e))
                unhealthy |= _devices_of_daemon(key, observed)
        return unhealthy, ops, unwanted

    def _daemonless(
        self, spec: NodePartitioningSpec | None, observed: list[ObservedGpu]
    ) -> set[str]:
        """Devices whose MPS daemon does not run now: Unhealthy until a pass starts it (a
        client given one would run outside MPS, holding the GPU the daemon then waits for);
        likewise a daemon whose limits are pending (a client would run without them)."""
        running = self._supervisor.running() - self._supervisor.limits_pending()
        hybrid = _hybrid_gpus(spec)
        out: set[str] = set()
        for g in observed:
            i = g.info.index
            if not g.info.mig_enabled and g.slices and mps_key(i) not in running:
                out |= {s.device_id for s in g.slices}
            for inst in g.instances:
                if not inst.uuid or mps_key(i, inst.start) in running:
                    continue
                if i in hybrid:
                    out.add(inst.uuid)
                    out |= {s.device_id for s in inst.slices or ()}
                elif inst.slices:  # a host outside a hybrid spec, its daemon stopped
                    out |= {s.device_id for s in inst.slices}
        return out

    async def _stop_daemons(
        self, keys: set[str], observed: list[ObservedGpu], errors: list[str]
    ) -> None:
        """Stop unwanted daemons that have no client, never one a pod uses.

        The devices published just before no longer name these daemons' pipes, so no new
        ``Allocate`` can make a client of them; a pod given such a device before that is in a
        fresh in-use read (PodResources or the allocation ledger), which keeps its daemon.
        Unreadable in-use ids stop nothing (retried next pass), nor does a ``quit`` that
        fails: the daemon stays supervised, and the next pass stops it again (an error now)."""
        fresh = await self._read_in_use(errors)
        if fresh is None:
            return
        for key in sorted(keys):
            if not _daemon_in_use(key, observed, fresh):  # never kill the MPS clients of a pod
                try:
                    self._supervisor.stop(key)
                except MpsError as e:
                    errors.append(str(e))

    def _discover(self, observed: list[ObservedGpu], complete: bool = True) -> None:
        """Once, on the first pass that read the GPUs: take over the MPS daemons an earlier
        agent left running (an agent restart or rollout), so that none is started twice and
        none a pod uses is stopped as unknown.  Candidates: every whole GPU's daemon and every
        MIG instance's (hybrid) daemon; the supervisor probes their pipe directories."""
        if self._discovered:
            return
        candidates: list[MpsDaemonSpec] = []
        for g in observed:
            i = g.info.index
            if not g.info.mig_enabled:
                candidates.append(self._daemon(mps_key(i), g.info.uuid, i, None))
            candidates += [
                self._daemon(mps_key(i, inst.start), inst.uuid, i, inst.start)
                for inst in g.instances
                if inst.uuid
            ]
        self._supervisor.discover(candidates)
        self._discovered = complete  # an unreadable GPU's daemons: looked for again next pass

    def _default_compute_mode(self, observed: list[ObservedGpu], errors: list[str]) -> int:
        """Draining: put every whole GPU in compute mode ``EXCLUSIVE_PROCESS`` whose MPS daemon
        no longer runs and that runs no process back in ``DEFAULT``.  Returns the NVML calls."""
        running = self._supervisor.running()
        ops = 0
        for g in observed:
            i = g.info.index
            info = g.info
            if info.mig_enabled or info.compute_mode != ComputeMode.EXCLUSIVE_PROCESS:
                continue
            if mps_key(i) in running:
                continue
            try:
                if self._nvml.running_processes(i):
                    continue  # retried next pass
                self._nvml.set_compute_mode(i, ComputeMode.DEFAULT)
                ops += 1
            except NvmlError as e:
                errors.append(f"GPU {i}: restoring compute mode DEFAULT: {e}")
        return ops

    def _exclusive_process(self, g: ObservedGpu) -> int:
        """Put an MPS GPU whose daemon is down in compute mode EXCLUSIVE_PROCESS, if idle."""
        mode = g.info.compute_mode
        if mode == ComputeMode.EXCLUSIVE_PROCESS:
            return 0
        i = g.info.index
        if g.gpu_processes:
            raise MpsError(
                f"GPU {i}: MPS needs compute mode EXCLUSIVE_PROCESS but the GPU is in "
                f"{mode.name} with {g.gpu_processes} process(es) running; the daemon starts "
                "once they have ended"
            )
        self._nvml.set_compute_mode(i, ComputeMode.EXCLUSIVE_PROCESS)
        return 1

    def _daemon(
        self,
        key: str,
        uuid: str,
        gpu: int,
        mig_start: int | None,
        slices: tuple[MpsSlot, ...] = (),
        *,
        whole_mib: int | None = None,
    ) -> MpsDaemonSpec:
        """The daemon of a GPU (or hybrid instance); a GPU's daemon-side limits are those of its
        largest slice, so no client can exceed it whatever its env says (node_agent.mps).

        Without slices (a hybrid instance advertised whole) the limits are 100 % and
        ``whole_mib``, the instance's memory: a pinned limit a running daemon got for the
        slices it hosted before is raised to the whole instance, never left capping its pod
        (sending no limit would keep the old one)."""
        return MpsDaemonSpec(
            key=key,
            device_uuid=uuid,
            pipe_dir=mps_pipe_directory(self._pipe_root, gpu, mig_start),
            log_dir=f"{self._log_root}/{key}",
            default_thread_percentage=max((s.thread_percentage for s in slices), default=100),
            default_pinned_mem_limit_mib=max((s.memory_mib for s in slices), default=whole_mib),
        )

    def _devices(
        self,
        spec: NodePartitioningSpec | None,
        actual: list[ActualGpu],
        unhealthy: set[str],
        observed: list[ObservedGpu],
    ) -> dict[str, list[AdvertisedDevice]]:
        """The devices to advertise; neither a lost host (:meth:`_sort_rebuilt`) nor a split
        instance (:attr:`~node_agent.gpu_plan.ObservedInstance.split`) is one."""
        devices = advertised_devices(
            actual,
            mps_pipe_root=self._pipe_root,
            unhealthy=unhealthy,
            hybrid_gpus=_hybrid_gpus(spec),
        )
        hidden = self._lost_hosts | {
            inst.uuid for g in observed for inst in g.instances if inst.split
        }
        if not hidden:
            return devices
        return {
            r: kept for r, ds in devices.items() if (kept := [d for d in ds if d.id not in hidden])
        }

    # -- the pass ----------------------------------------------------------------------

    async def reconcile(
        self,
        spec: NodePartitioningSpec | None,
        generation: int = 0,
        *,
        previous: NodePartitioningStatus | None = None,
        now: str = "",
    ) -> ReconcileResult:
        """One pass: read, plan, withdraw, execute, re-read, report (module docstring)."""
        errors: list[str] = []
        in_use = await self._read_in_use(errors)
        try:
            observed, unreadable = self._observe(in_use)
        except NvmlError as e:
            errors.append(f"reading GPUs: {e}")
            return self._failed_read(spec, generation, previous, now, errors)
        self._discover(observed, complete=not unreadable)
        self._sort_rebuilt(spec, observed, in_use, previous)
        lost = self._last_known(unreadable, previous)
        self._take_xids(observed, lost)
        plans, blocks = self._plan(spec, observed, unreadable)
        by_index = {g.info.index: g for g in observed}

        doomed = {i: self._doomed(by_index[i], p) for i, p in plans.items()}
        if any(doomed.values()):
            if self._publish is not None:
                all_doomed = set().union(*doomed.values())
                now_actual = _by_index(actual_gpus(observed) + lost)
                current = self._devices(
                    spec,
                    now_actual,
                    self._daemonless(spec, observed)
                    | _device_ids(lost)
                    | unhealthy_ids(self._xid_marks, now_actual),
                    observed,
                )
                self._publish(
                    {r: [d for d in ds if d.id not in all_doomed] for r, ds in current.items()}
                )
            fresh = await self._read_in_use(errors)
            for i, ids in doomed.items():
                if not ids:
                    continue
                if fresh is None or ids & fresh:
                    plans.pop(i)
                    blocks[i] = Block(
                        "InUseChanged",
                        f"GPU {i}: devices to remove were allocated meanwhile or in-use ids are "
                        "unreadable; retrying",
                        transient=True,
                    )
            if fresh is not None:
                in_use = fresh

        ops = 0
        for i, plan in sorted(plans.items()):
            ops += self._execute(by_index[i], plan, blocks, errors)
        self._note_gi_changes()

        if ops or plans:
            before = {inst.uuid for g in observed for inst in g.instances if inst.uuid}
            try:
                observed, again = self._observe(in_use)
            except NvmlError as e:
                errors.append(f"re-reading GPUs: {e}")
                return self._failed_read(spec, generation, previous, now, errors, ops)
            if again.keys() - unreadable.keys():  # a GPU failed after the first read
                unreadable = {**again, **unreadable}
                blocks.update({i: unreadable_block(i, e) for i, e in again.items()})
                lost = self._last_known(unreadable, previous)
            observed = [g for g in observed if g.info.index not in unreadable]
            observed = self._fill_new_hosts(spec, observed, before, blocks)
            self._rebuilt.clear()  # instances this pass made: the agent's own, not lost
        unhealthy, mode_ops, unwanted = self._sync_daemons(spec, observed, errors, unreadable)
        ops += mode_ops
        read = actual_gpus(observed)
        self._known.update((a.index, a) for a in read)
        actual = _by_index(read + lost)
        xid_bad = unhealthy_ids(self._xid_marks, actual)
        devices = self._devices(spec, actual, unhealthy | _device_ids(lost) | xid_bad, observed)
        # a GPU whose MPS slice table is unknown (restart + PodResources down) would be
        # advertised without its slices: publish nothing until the table is rebuilt
        complete = all(
            g.slices is not None and all(i.slices is not None for i in g.instances)
            for g in observed
        )
        draining = spec is None
        held: tuple[str, ...] = ()
        if draining:
            # only what pods hold stays advertised; in-use ids unknown: publish nothing
            complete = complete and in_use is not None
            kept = in_use or set()
            devices = {
                r: held_here
                for r, ds in devices.items()
                if (held_here := [d for d in ds if d.id in kept])
            }
            held = tuple(sorted(d.id for ds in devices.values() for d in ds))
        if self._publish is not None and complete:
            self._publish(devices)
        if unwanted:  # after the publish: no device names their pipes any more
            await self._stop_daemons(unwanted, observed, errors)
        if draining:
            ops += self._default_compute_mode(observed, errors)
        add_xid_blocks(blocks, self._xid_marks)
        whole = {g.index for g in lost} | {m.gpu for m in self._xid_marks if not m.device}
        status = build_status(
            spec=spec,
            generation=generation,
            observed=observed,
            blocks=blocks,
            errors=errors,
            previous=previous,
            now=now,
            actual=flag_unhealthy(actual, whole, xid_bad),
        )
        applied = bool(status.conditions) and status.conditions[0].status == "True"
        self._note_gi_changes()  # an event the watcher got late is covered too
        return ReconcileResult(
            status,
            devices,
            applied,
            blocks,
            errors,
            ops,
            fresh=complete,
            draining=draining,
            held=held,
        )

    def _take_xids(self, observed: list[ObservedGpu], lost: list[ActualGpu]) -> None:
        """Resolve the XID events the watcher saw since the last pass into marks (kept)."""
        if self._xids is None:
            return
        first, new = self._xids.take_numbered()
        changed, self._gi_changed = self._gi_changed, {}
        # events that came in before the last GI changes were made (and those kept from an
        # earlier pass) may be about an instance whose GI id was reused: see node_agent.xid
        cut = max(0, min(len(new), self._changed_before - first))
        early = self._xid_later + new[:cut]
        if not early and not new:
            return
        marks, later = resolve(early, observed, lost, changed)
        more, later2 = resolve(new[cut:], observed, lost)
        marks += more
        self._xid_later = later + later2
        for g in {e.gpu for e in later}:  # kept for the events tried again
            if g is not None and g in changed:
                self._gi_changed.setdefault(g, set()).update(changed[g])
        for m in marks:
            if m not in self._xid_marks:
                self._xid_marks.append(m)

    def _note_gi_changes(self) -> None:
        """After this pass's GI changes: the XID events the ledger has now may predate them."""
        if self._xids is not None and self._gi_changed:
            self._changed_before = self._xids.added

    def _last_known(
        self, unreadable: Mapping[int, NvmlError], previous: NodePartitioningStatus | None
    ) -> list[ActualGpu]:
        """The last state read of each unreadable GPU: this agent's, else the previous status's
        (none known: the GPU is neither advertised nor listed in the status)."""
        before = {g.index: g for g in previous.gpus} if previous is not None else {}
        out: list[ActualGpu] = []
        for i in sorted(unreadable):
            known = self._known.get(i) or before.get(i)
            if known is not None:
                out.append(known)
        return out

    def _failed_read(
        self,
        spec: NodePartitioningSpec | None,
        generation: int,
        previous: NodePartitioningStatus | None,
        now: str,
        errors: list[str],
        ops: int = 0,
    ) -> ReconcileResult:
        """NVML could not be read: report the error, keep the last known GPUs, publish nothing."""
        status = build_status(
            spec=spec,
            generation=generation,
            observed=[],
            blocks={},
            errors=errors,
            previous=previous,
            now=now,
        )
        if previous is not None:
            status = status.model_copy(update={"gpus": previous.gpus})
        return ReconcileResult(
            status,
            {},
            False,
            {},
            errors,
            ops,
            fresh=False,
            draining=spec is None,
            nvml_failed=True,
        )


RESET_REMEDY = {
    NvmlErrorCode.NOT_SUPPORTED: "give the agent the host driver's nvidia-smi "
    "(NVIDIA_DRIVER_CAPABILITIES=utility, or GPUSLICE_NVIDIA_SMI), or reset GPU {gpu} yourself "
    "(nvidia-smi -r -i {bus}) or reboot the node",
    NvmlErrorCode.IN_USE: "another client holds the GPU (nvidia-persistenced, DCGM or "
    "dcgm-exporter, Fabric Manager, a process outside Kubernetes): stop it, or reset GPU {gpu} "
    "(nvidia-smi -r -i {bus}) or reboot the node",
    NvmlErrorCode.NO_PERMISSION: "the agent may not reset GPUs here: run it privileged "
    "(chart value agent.privileged=true), or reset GPU {gpu} (nvidia-smi -r -i {bus}) or reboot "
    "the node",
}
"""Reset failures that need the operator: the remedy named in the ``MIGModePending`` block."""


def mps_key(gpu: int, mig_start: int | None = None) -> str:
    """The supervisor key of a GPU's (or hybrid MIG instance's) MPS daemon."""
    return f"gpu{gpu}" if mig_start is None else f"gpu{gpu}-mig{mig_start}"


NVML_DOWN = frozenset(
    {
        NvmlErrorCode.UNINITIALIZED,
        NvmlErrorCode.DRIVER_NOT_LOADED,
        NvmlErrorCode.LIBRARY_NOT_FOUND,
        NvmlErrorCode.FUNCTION_NOT_FOUND,
        NvmlErrorCode.LIB_RM_VERSION_MISMATCH,
    }
)
"""Codes that say NVML itself is down, not one GPU: the whole pass fails."""


def unreadable_block(
    gpu: int, e: NvmlError, devices: str = "its devices are advertised Unhealthy"
) -> Block:
    """The ``Degraded`` block ``GpuUnreadable`` of a GPU NVML cannot read, naming the GPU and the
    error; ``devices`` says what became of its devices (the DRA agent withdraws the free ones)."""
    return Block(
        "GpuUnreadable",
        f"GPU {gpu}: NVML cannot read it ({e}); {devices} and nothing on it is changed until "
        "it reads again",
    )


def _by_index(gpus: list[ActualGpu]) -> list[ActualGpu]:
    return sorted(gpus, key=lambda g: g.index)


def _device_ids(gpus: list[ActualGpu]) -> set[str]:
    """Every device id of ``gpus``: MIG instances, their hosted slices, MPS slices
    (:func:`node_agent.xid.device_ids`)."""
    out: set[str] = set()
    for g in gpus:
        out |= device_ids(g)
    return out


def _key_gpu(key: str) -> int | None:
    """The GPU index of an MPS daemon key (:func:`mps_key`)."""
    head = key.split("-", 1)[0]
    return int(head[3:]) if head.startswith("gpu") and head[3:].isdigit() else None


def _hybrid_gpus(spec: NodePartitioningSpec | None) -> set[int]:
    if spec is None or spec.mode != "hybrid":
        return set()
    return {d.index for d in spec.gpus}


def _used(slices: tuple[MpsSlot, ...] | None, in_use: set[str] | None) -> frozenset[str]:
    """Ids of ``slices`` that pods hold (all of them when ``in_use`` is unknown)."""
    if in_use is None:
        return frozenset(s.device_id for s in slices or ())
    return frozenset(s.device_id for s in slices or () if s.device_id in in_use)


def _same_profile(model: GpuModel, name: str, profile_id: int) -> bool:
    try:
        return model.profile(name).profile_id == profile_id
    except CatalogError:
        return False


def _devices_of_daemon(key: str, observed: list[ObservedGpu]) -> set[str]:
    for g in observed:
        i = g.info.index
        if key == mps_key(i):
            return {s.device_id for s in g.slices or ()}
        for inst in g.instances:
            if key == mps_key(i, inst.start) and inst.uuid:
                return {inst.uuid} | {s.device_id for s in inst.slices or ()}
    return set()


MPS_SERVER = "nvidia-cuda-mps-server"
"""The process an MPS control daemon starts for its clients (its name as NVML reports it)."""


def _fields(inst: ObservedInstance) -> dict[str, Any]:
    """The fields of an :class:`ObservedInstance` (``dataclasses.asdict`` would copy them
    deeply, turning the profile and the slots into dicts)."""
    return {name: getattr(inst, name) for name in ObservedInstance.__dataclass_fields__}


def workload(nv: Nvml, gpu: int, gi_id: int | None = None) -> list[int]:
    """The compute processes on a GPU (or MIG instance ``gi_id``) other than MPS servers.

    An MPS server is the daemon's, not a pod's: it stays on the device after its last client
    ended, until the daemon quits (read on an H100, tests/fixtures/hardware), so counting it
    would keep an idle daemon "in use" and its GPU or instance from ever being repartitioned.
    Every MPS client is a process of its own in the same list, so nothing a pod runs is
    missed."""
    return [
        p
        for p in nv.running_processes(gpu, gi_id)
        if nv.process_name(p).rsplit("/", 1)[-1] != MPS_SERVER
    ]


def _daemon_in_use(key: str, observed: list[ObservedGpu], in_use: set[str]) -> bool:
    """A pod (or a process) may be a client of daemon ``key``: its GPU has a used slice or
    processes, its hybrid instance is used, or ``in_use`` (a fresher read than ``observed``'s)
    holds one of its devices -- any MPS slice id of the GPU, even one no longer in the table."""
    for g in observed:
        i = g.info.index
        if key == mps_key(i):
            if g.used_slices or g.gpu_processes:
                return True
            return any(
                (sid := parse_mps_slice_id(dev)) is not None and sid.gpu_uuid == g.info.uuid
                for dev in in_use
            )
        for inst in g.instances:
            if key != mps_key(i, inst.start):
                continue
            if inst.used or inst.uuid in in_use:
                return True
            if inst.uuid and any(  # a slice of this instance, even one no longer in its table
                (sid := parse_mps_slice_id(dev)) is not None and sid.gpu_uuid == inst.uuid
                for dev in in_use
            ):
                return True
    return False
