"""Preparing DRA claims on this node's GPUs: create (or find) each allocated MIG instance at its
placement, or hand out a whole GPU; release it at unprepare; never touch another claim's.

Model
-----
An allocation result names a device of this node's pool (:mod:`node_agent.dra_claims`): a MIG
placement ``(GPU, profile, start)`` or a whole GPU.  Kube-scheduler chose it against the
ResourceSlice counters (:mod:`node_agent.dra_slices`), which make overlapping placements
exclusive; the driver still checks the hardware itself, because allocations made against an
older publication stay valid and another tool may have touched the GPU.

*Ownership.*  An instance belongs to a claim when its MIG device UUID is in that claim's
:class:`~node_agent.dra_checkpoint.ClaimRecord` (GI ids are reused by the driver; a MIG UUID is
fresh for every compute instance).  A whole GPU belongs to the claim that recorded it.  Any
other instance is *unknown*.

*Prepare* ``(claim, devices)``, serialized node-wide:

1. A ``completed`` record of the same device set answers at once, after checking that every
   instance still exists (a reboot drops MIG instances: missing ones are created again, at the
   same placements).  A record of another device set (the claim was deallocated and allocated
   again) is released first, if idle.  A ``started`` record (the agent died mid-prepare) is
   rolled back first.
2. The record is written ``started`` before the first NVML mutation and after each instance.
3. Whole GPU: refused if another claim holds an instance or the GPU; unknown instances are
   destroyed if idle (refused if they run processes); MIG mode is disabled.
4. Placement: refused if another claim holds the whole GPU or an overlapping instance, or
   its record holds a device the ResourceSlice counters refuse beside the placement (its
   instance may be gone since a reboot, until the kubelet prepares it again), or an
   unknown overlapping instance runs processes; idle unknown overlapping instances are
   destroyed; MIG mode is enabled if off (GPU idle, compute mode DEFAULT; a change NVML leaves
   pending -- Ampere: activation status ``RESET_REQUIRED`` (a pass-through VM), or ``IN_USE``
   with the mode read back pending -- waits for a GPU reset, which the driver runs on the idle GPU; one NVML did
   not record -- Hopper busy at the switch -- fails the prepare, no reset:
   :func:`~node_agent.reconciler.mig_activation`); an instance of exactly that
   profile and placement that nobody owns is adopted (its compute instance created if
   missing); else the GPU instance is created at the placement with its full-size compute
   instance.  If the driver refuses for lack of resources (compute slices or a profile's
   maximum count held by unknown idle instances elsewhere on the GPU), those are destroyed and
   the creation is tried once more.
5. Any failure rolls back what this call created (idle by construction) and fails the claim
   with a message naming it; the kubelet retries.  An instance it adopted (step 4) is left in
   place, idle and owned by no one, as it was; a ``started`` record rolled back at the
   agent's start keeps its instances at planned placements (as unprepare does).  Success writes the CDI spec
   (:mod:`node_agent.cdi`) and the ``completed`` record.

*Unprepare* ``(uid)``: an unknown claim is success (idempotent; the claim may be gone).  If any
of its instances (or its whole GPU) runs processes, nothing is released and the call fails
(the kubelet retries once the containers are gone); else each MIG instance is destroyed (compute instance first; an
instance already gone is fine), the CDI spec removed and the record dropped.  A whole GPU keeps
its MIG mode (the next prepare switches it if needed).  Destroying at unprepare keeps the GPU
equal to what the counters say is free: an idle instance left behind would block placements
the scheduler may allocate next.  Except under planner-shaped publishing
(:mod:`node_agent.dra_shape`): an instance whose placement is in :attr:`DraPreparer.planned`
(the spec's placements) stays, idle and owned by no claim, so the next claim allocated that
placement adopts it (step 4) and nothing is reconfigured; it blocks nothing the scheduler can
allocate, because a published device overlapping it is allocated only through prepare, which
destroys idle unknown instances in its way.

*Unknown instances at start* (:meth:`DraPreparer.clean_unknown`): idle ones are destroyed
(except, under shaped publishing, those at planned placements), used ones kept and reported;
``started`` records are rolled back.  :meth:`DraPreparer.destroy_idle` (each shaped round)
destroys the idle unknown instances outside a given set of placements;
:meth:`DraPreparer.make_planned` then creates the planned ones and returns what it could not
make, with why (:class:`PlannedOutcome`: a GPU whose MIG mode could not be switched on, a
creation that failed), and the MIG mode NVML reads on each GPU.  Nothing a prepared
claim uses is ever destroyed: every destroy is of an unknown idle instance or of the claim's
own, idle, at its unprepare.

*An unreadable GPU* (NVML fails reading that GPU alone: its ``gpus(isolate=True)`` entry
carries a ``read_error``, or its instances, MIG devices or processes cannot be read --
``GPU_IS_LOST`` typically) is left exactly as it is, as the device-plugin agent does
(:mod:`node_agent.reconciler`): before anything is done on a GPU its reads are tried
(:meth:`DraPreparer._check_readable`), and an unreadable one raises :class:`GpuUnreadable`
naming the GPU and the NVML error.  So prepare answers that claim's error (the kubelet
retries; a ``completed`` record there is neither re-made nor dropped), unprepare fails and keeps
the record until the GPU reads again, the clean-ups (:meth:`DraPreparer.clean_unknown`,
:meth:`DraPreparer.destroy_idle`) skip the GPU -- an unfinished prepare's record there stays,
rolled back later -- and :meth:`DraPreparer.create_planned` skips the GPUs it is told to.
Claims on the other GPUs are prepared and released as usual.  :meth:`DraPreparer.unreadable`
lists the unreadable GPUs for a publish round.  NVML itself down (the device count unreadable,
or a driver-wide code, :data:`node_agent.reconciler.NVML_DOWN`) is not isolated: the
:class:`~node_agent.nvml.NvmlError` propagates (a clean-up or publish round fails).

*A GPU unreadable when the agent starts* has no known model, so it is in neither
:attr:`DraPreparer.models` nor :attr:`DraPreparer.targets`: it is kept in
:attr:`DraPreparer.pending`, listed by :meth:`DraPreparer.unreadable` like a GPU lost later (so
the shaped status reports it), and tried again every publish round by
:meth:`DraPreparer.read_pending`, which adds it to the models and targets once it reads -- the
driver then publishes it like the others, without a restart.

*An XID* (a critical error NVML reported, :mod:`node_agent.xid`; the driver hands the events
to :meth:`DraPreparer.mark_xids`) marks, until the agent restarts, the placement of the GPU
instance it names (its profile and start, read from NVML when the event is resolved, at once),
else -- not MIG-scoped, no such instance now, the GPU unreadable, or no GPU named (then every
GPU) -- the whole GPU.  The driver reuses GPU instance ids, so an event that came in before a
prepare, unprepare or round destroyed or created a GPU instance of the id it names may be about
the old instance or the new one: every such destroy and create is stamped with the XID
ledger's count of events (:attr:`DraPreparer.xid_clock`, set by the driver), and an event the
ledger got before the stamp of the id it names marks the whole GPU, never the new instance by
guess (:meth:`DraPreparer.mark_numbered_xids`; the device-plugin agent's rule,
:mod:`node_agent.xid`, "GPU instance ids the agent reused").  A device is *unhealthy* when it
shares a memory slot with a marked placement (the whole GPU device shares every slot; a
whole-GPU mark makes every device of the GPU unhealthy) -- the counters let any such device be
allocated once the hit instance's claim ends, so all of them, not only the placement hit, are
kept from new claims (:meth:`DraPreparer.xid_devices`; the driver withdraws the free ones under
shaped publishing, and in mode ``all`` publishes them with the ``NoSchedule`` unusable taint
where the API server keeps device taints, else withdraws their GPU's free devices:
:mod:`node_agent.dra_driver`).  Then:

* prepare refuses a claim with an unhealthy device, with an error naming the GPU and the XID
  (the kubelet retries; the pod waits), except a claim already prepared with those devices and
  whose instances are all there: it answers them as before, its pod keeps what it has;
* nothing an XID hit is created or destroyed: an instance whose memory slots overlap a marked
  placement (every instance of a GPU marked whole) is never destroyed -- unprepare releases the
  claim (record, CDI spec) but leaves its instance, idle and owned by no claim, and the
  clean-ups and the retry after ``INSUFFICIENT_RESOURCES`` skip it -- and
  :meth:`DraPreparer.create_planned` makes no unhealthy placement.  The rest of an instance-
  marked GPU is served as usual.

*adminAccess.*  A result with ``adminAccess`` (KEP-5018; only in namespaces labelled
``resource.kubernetes.io/admin-access=true``) is not an allocation: kube-scheduler does not
count it as allocated (shared/facts/dra.md), so it gives an admin claim a device another claim
holds, and an ordinary claim a device an admin claim has.  Such a result gets the device *as it
is*: the whole GPU's UUID whatever its MIG mode, or the MIG device of the instance that exists
at the placement now (whoever owns it, or no one); its CDI device is written and its record
kept (:attr:`~node_agent.dra_checkpoint.PreparedDevice.admin_access`), but it owns nothing
(:meth:`DraPreparer._owners` and the recorded-conflict check skip it), so it never conflicts
with the device's owner and an ordinary claim prepared after it creates or adopts the instance
as usual.  Nothing is created, destroyed or switched for it: with no MIG device at the placement
prepare answers that claim's error (the kubelet retries), and unprepare drops the record and
the CDI spec only, waiting for no process.  The owner's unprepare may still destroy the
instance under it.  An XID does not refuse it (nothing is made; diagnosing is its use).

Processes: NVML's compute processes on the instance or GPU, less MPS servers (the same rule as
the reconciler's, :func:`node_agent.reconciler.workload`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from node_agent.cdi import cdi_device_id, cdi_spec, remove_spec, write_spec
from node_agent.dra_checkpoint import Checkpoint, ClaimRecord, PreparedDevice
from node_agent.dra_claims import AllocatedDevice, ClaimError, ClaimRef, DeviceTarget
from node_agent.dra_claims import device_targets as _targets
from node_agent.dra_foreign import ForeignUse
from node_agent.dra_slices import (
    DRIVER,
    DraGpu,
    device_name,
    gpu_counters,
    placement_counters,
)
from node_agent.nvml import (
    ComputeMode,
    GpuInfo,
    GpuInstanceInfo,
    Nvml,
    NvmlError,
    NvmlErrorCode,
    XidEvent,
)
from node_agent.reconciler import NVML_DOWN, RESET_REMEDY, mig_activation, workload
from node_agent.xid import RECOVERY, XidMark, xid_text
from planner.catalog import Catalog, GpuModel

__all__ = ["DraPreparer", "GpuUnreadable", "PlannedOutcome", "gpu_models"]

log = logging.getLogger(__name__)


def gpu_models(
    nvml: Nvml, catalog: Catalog, unread: dict[int, NvmlError] | None = None
) -> dict[int, GpuModel]:
    """The catalog model of every GPU NVML lists (by PCI device id, else by product name);
    GPUs of unknown models are left out (they are not published), and so are GPUs NVML cannot
    read now (``GPU_IS_LOST``: their model is unknown; the other GPUs are served), each with its
    error put in ``unread`` when given (:attr:`DraPreparer.pending`: tried again every publish
    round).  NVML itself down raises."""
    out: dict[int, GpuModel] = {}
    for info in nvml.gpus(isolate=True):
        if info.read_error is not None:
            if info.read_error.code in NVML_DOWN:
                raise info.read_error
            log.error(
                "GPU %d cannot be read by NVML (%s); not published until it reads (tried again "
                "every publish round)",
                info.index,
                info.read_error,
            )
            if unread is not None:
                unread[info.index] = info.read_error
            continue
        model = catalog.model_for_device(info.pci_device_id, info.name)
        if model is None:
            log.warning("GPU %d (%s) is not in the catalog; not published", info.index, info.name)
        else:
            out[info.index] = model
    return out


class GpuUnreadable(ClaimError):
    """NVML cannot read GPU ``gpu`` (``error``): nothing on it is done until it reads again."""

    def __init__(self, gpu: int, error: NvmlError) -> None:
        self.gpu = gpu
        self.error = error
        super().__init__(
            f"GPU {gpu} cannot be read by NVML ({error}): nothing on it is prepared, released "
            "or cleaned up until it reads again"
        )


@dataclass(frozen=True, slots=True)
class PlannedOutcome:
    """What one :meth:`DraPreparer.make_planned` did: the instances it created, and the planned
    placements it could not make, with why (shaped publishing withdraws those and its status
    reports them: :mod:`node_agent.dra_shape`)."""

    created: int = 0
    mode_failed: Mapping[int, str] = field(default_factory=dict)
    """GPU index -> why its MIG mode could not be switched on (a reset that cannot run, the
    GPU not idle): none of its planned placements was made, and prepare fails the same way."""
    failed: Mapping[str, str] = field(default_factory=dict)
    """Device name -> why the instance of that planned placement could not be created."""
    unmade: frozenset[str] = frozenset()
    """The planned placements not made for those reasons (every placement tried on a
    :attr:`mode_failed` GPU, and the :attr:`failed` ones)."""
    mig_enabled: Mapping[int, bool] = field(default_factory=dict)
    """The MIG mode NVML reads on each GPU after the round (a GPU it cannot read is left
    out)."""


def _isolated(gpu: int, e: NvmlError) -> NvmlError | GpuUnreadable:
    """What a failed read of GPU ``gpu`` raises: :class:`GpuUnreadable`, or ``e`` itself when its
    code says NVML is down (not isolated)."""
    return e if e.code in NVML_DOWN else GpuUnreadable(gpu, e)


class DraPreparer:
    """Prepare and unprepare claims (module docstring).  Thread-safe; blocking (NVML)."""

    def __init__(
        self,
        nvml: Nvml,
        catalog: Catalog,
        *,
        node: str,
        checkpoint: Checkpoint | None = None,
        cdi_dir: str | Path | None = None,
        driver: str = DRIVER,
    ) -> None:
        self._nvml = nvml
        self._catalog = catalog
        self.node = node
        self.checkpoint = checkpoint if checkpoint is not None else Checkpoint(None)
        self.cdi_dir = cdi_dir
        self.driver = driver
        self._lock = threading.Lock()
        self.pending: dict[int, NvmlError] = {}
        """GPUs NVML could not read when the agent started (model unknown, so not in
        :attr:`models`), with the last error; :meth:`read_pending` adds one once it reads."""
        self.models = gpu_models(nvml, catalog, self.pending)
        self.targets: dict[str, DeviceTarget] = _targets(self.models)
        self.xid_marks: tuple[XidMark, ...] = ()
        """The critical XIDs seen so far (:meth:`mark_xids`; module docstring, "An XID"):
        ``device`` is the placement's device name, ``""`` the whole GPU.  Kept until the agent
        restarts."""
        self.xid_clock: Callable[[], int] | None = None
        """The XID ledger's count of events (:attr:`node_agent.xid.XidLedger.added`), set by
        the driver that resolves them: each GPU instance id destroyed or created is stamped
        with it (module docstring, "An XID"); ``None``: nothing is stamped."""
        self._gi_changed: dict[int, dict[int, int]] = {}
        """GPU index -> GPU instance id -> :attr:`xid_clock` just after that id was last
        destroyed or created: an event numbered below it may be about the old instance."""
        self.planned: frozenset[str] | None = None
        """Shaped publishing (:mod:`node_agent.dra_shape`): the device names of the spec's
        placements, whose idle instances unprepare and :meth:`clean_unknown` keep; ``None``
        (publishing every placement): they are destroyed."""

    # -- queries -----------------------------------------------------------------------

    def _info(self, gpu: int, listed: Sequence[GpuInfo] | None = None) -> GpuInfo:
        """GPU ``gpu`` as NVML lists it (or as ``listed``, one listing a loop over the GPUs
        reads once: NVML reads every GPU's entry per listing); raises :class:`GpuUnreadable`
        if its entry cannot be read (another GPU's read error does not matter),
        :class:`ClaimError` if it is gone."""
        for info in self._nvml.gpus(isolate=True) if listed is None else listed:
            if info.index == gpu:
                if info.read_error is not None:
                    raise _isolated(gpu, info.read_error)
                return info
        raise ClaimError(f"GPU {gpu} is gone from this node")

    def _probe(self, info: GpuInfo) -> None:
        """Read what prepare and the clean-ups read of a GPU (its instances and MIG devices,
        or its processes); a failure raises :class:`GpuUnreadable` (see :func:`_isolated`)."""
        try:
            if info.mig_enabled:
                self._instances(info.index)
            else:
                self._nvml.running_processes(info.index)
        except NvmlError as e:
            raise _isolated(info.index, e) from None

    def _check_readable(self, gpus: Iterable[int]) -> None:
        """Raise :class:`GpuUnreadable` for the first of ``gpus`` NVML cannot read."""
        for g in sorted(set(gpus)):
            self._probe(self._info(g))

    def unreadable(self) -> dict[int, NvmlError]:
        """The GPUs of this node (those with a catalog model) NVML cannot read now, with the
        error (module docstring); raises :class:`NvmlError` when NVML itself is down."""
        out: dict[int, NvmlError] = {}
        with self._lock:
            out.update(self.pending)
            for info in self._nvml.gpus(isolate=True):
                if info.index in self.models and (error := self._read_error(info)) is not None:
                    out[info.index] = error
        return out

    def _read_error(self, info: GpuInfo) -> NvmlError | None:
        """``None`` when GPU ``info`` reads (its entry, then its instances or processes), else
        its error (:func:`_isolated` raises for NVML itself down)."""
        try:
            if info.read_error is not None:
                raise _isolated(info.index, info.read_error)
            self._probe(info)
        except GpuUnreadable as e:
            return e.error
        return None

    def read_pending(self) -> list[DraGpu]:
        """Try again the GPUs NVML could not read at start (:attr:`pending`): one that reads now
        (its entry, then its instances or processes) and has a catalog model joins
        :attr:`models` and :attr:`targets` and is returned, to be published from this round on;
        one still unreadable keeps its newest error; one of a model the catalog lacks is
        dropped (not published, as at start).  NVML itself down raises."""
        if not self.pending:
            return []
        added: list[DraGpu] = []
        with self._lock:
            for info in self._nvml.gpus(isolate=True):
                if info.index not in self.pending:
                    continue
                if (error := self._read_error(info)) is not None:
                    self.pending[info.index] = error
                    continue
                del self.pending[info.index]
                model = self._catalog.model_for_device(info.pci_device_id, info.name)
                if model is None:
                    log.warning(
                        "GPU %d (%s) reads now but is not in the catalog; not published",
                        info.index,
                        info.name,
                    )
                    continue
                self.models = {**self.models, info.index: model}
                self.targets = _targets(self.models)
                added.append(DraGpu(info.index, info.uuid, model))
                log.info(
                    "GPU %d (%s), unreadable when the agent started, reads now: published",
                    info.index,
                    model.name,
                )
        return added

    # -- XID critical errors -------------------------------------------------------------

    def mark_xids(self, events: Sequence[XidEvent]) -> list[XidEvent]:
        """Resolve critical XID events into :attr:`xid_marks` (module docstring, "An XID");
        return the events of GPUs not served yet (:attr:`pending`), to be tried again once they
        read.  Events of a GPU not served at all (a model the catalog lacks) are dropped.
        The events are not numbered: each is resolved against the instances now
        (:meth:`mark_numbered_xids` tells reused GPU instance ids).  Reads NVML: called from a
        worker thread."""
        return [e for _, e in self.mark_numbered_xids([(None, e) for e in events])]

    def mark_numbered_xids(
        self, events: Sequence[tuple[int | None, XidEvent]], taken: int | None = None
    ) -> list[tuple[int | None, XidEvent]]:
        """:meth:`mark_xids` for events with their ledger numbers
        (:meth:`node_agent.xid.XidLedger.take_numbered`; ``None``: unknown, resolved against
        the instances now): an event numbered below the :attr:`xid_clock` stamp of the GPU
        instance id it names -- the id was destroyed or created after the event came in --
        marks the whole GPU (module docstring, "An XID").  ``taken``: the ledger's count when
        these events were taken; the stamps no event still to come can be older than are
        dropped.  Returns the events kept for later, with their numbers."""
        later: list[tuple[int | None, XidEvent]] = []
        with self._lock:
            marks = list(self.xid_marks)
            for n, e in events:
                if e.gpu is not None and e.gpu not in self.models:
                    if e.gpu in self.pending:
                        later.append((n, e))
                    continue
                for g in [e.gpu] if e.gpu is not None else sorted(self.models):
                    m = self._mark(g, e, n)
                    if m not in marks:
                        marks.append(m)
            self.xid_marks = tuple(marks)
            if taken is not None:
                oldest = min([taken, *(n for n, _ in later if n is not None)])
                for g, stamps in list(self._gi_changed.items()):
                    kept = {i: s for i, s in stamps.items() if s > oldest}
                    if kept:
                        self._gi_changed[g] = kept
                    else:
                        del self._gi_changed[g]
        return later

    def _mark(self, g: int, e: XidEvent, n: int | None = None) -> XidMark:
        """The mark of event ``e`` (ledger number ``n``) on GPU ``g``: the placement of the
        GPU instance it names, else (not MIG-scoped, no such instance now, the GPU
        unreadable, or that GPU instance id destroyed or created since the event came in) the
        whole GPU."""
        uuid = ""
        try:
            info = self._info(g)
            uuid = info.uuid
            if e.gi_id is not None and n is not None:
                stamp = self._gi_changed.get(g, {}).get(e.gi_id)
                if stamp is not None and n < stamp:
                    where = (
                        f"the whole GPU (GPU instance {e.gi_id} was destroyed or created while "
                        "the event came in, so the instance hit cannot be told)"
                    )
                    return XidMark(g, e.xid, uuid, "", where)
            if e.gi_id is not None and info.mig_enabled:
                for gi, mig_uuid in self._instances(g):
                    name = _placement(g, self.models[g], gi)
                    if gi.gi_id == e.gi_id and name is not None and name in self.targets:
                        t = self.targets[name]
                        assert t.profile is not None
                        where = (
                            f"MIG instance {t.profile.name} at memory slot {gi.start} (GPU "
                            f"instance {gi.gi_id}, {mig_uuid or 'no compute instance'})"
                        )
                        return XidMark(g, e.xid, uuid, name, where)
        except (ClaimError, NvmlError):
            pass  # unreadable or gone: the whole GPU
        return XidMark(g, e.xid, uuid)

    def _gi_changed_now(self, g: int, gi_id: int) -> None:
        """Stamp GPU instance id ``gi_id`` of GPU ``g``, just destroyed or created, with
        :attr:`xid_clock` (:meth:`mark_numbered_xids`)."""
        if self.xid_clock is not None:
            self._gi_changed.setdefault(g, {})[gi_id] = self.xid_clock()

    def xid_mark_of(self, name: str) -> XidMark | None:
        """The XID mark that makes device ``name`` unhealthy: one of its GPU's marks whose
        placement shares a memory slot with it (a whole-GPU mark, or the whole GPU device,
        shares every slot); ``None``: none."""
        t = self.targets.get(name)
        if t is None:
            return None
        for m in self.xid_marks:
            if m.gpu != t.gpu:
                continue
            hit = self.targets.get(m.device) if m.device else None
            if hit is None or hit.profile is None or t.profile is None:
                return m
            if set(t.profile.span(t.start)) & set(hit.profile.span(hit.start)):
                return m
        return None

    def xid_devices(self) -> set[str]:
        """Every device an XID mark makes unhealthy (:meth:`xid_mark_of`)."""
        if not self.xid_marks:
            return set()
        return {n for n in self.targets if self.xid_mark_of(n) is not None}

    def _xid_keeps(self, g: int, gi: GpuInstanceInfo) -> bool:
        """Is instance ``gi`` of GPU ``g`` one an XID hit (its GPU marked whole, or its memory
        slots overlapping a marked placement)?  Such an instance is never destroyed."""
        slots = set(range(gi.start, gi.start + gi.size))
        for m in self.xid_marks:
            if m.gpu != g:
                continue
            hit = self.targets.get(m.device) if m.device else None
            if hit is None or hit.profile is None or slots & set(hit.profile.span(hit.start)):
                return True
        return False

    def _refuse_xid(self, ref: ClaimRef, devices: Sequence[AllocatedDevice]) -> None:
        """Raise :class:`ClaimError` naming the GPU and the XID if an XID mark makes one of
        ``devices`` unhealthy: nothing is made there until the agent restarts.  An
        ``adminAccess`` device is not refused: it makes nothing, and looking at a device an XID
        hit is what admin access is for."""
        for a in devices:
            m = None if a.admin_access else self.xid_mark_of(a.device)
            if m is not None:
                raise ClaimError(
                    f"{ref}: device {a.device} is unhealthy: NVML reported {xid_text(m.xid)} on "
                    f"GPU {m.gpu} ({m.where or 'the whole GPU'}); nothing there is prepared "
                    f"{RECOVERY}"
                )

    def _owners(self, gpu: int) -> dict[str, tuple[ClaimRecord, PreparedDevice]]:
        """UUID (MIG device or whole GPU) -> owning claim, for devices on ``gpu``.  A device
        prepared for an ``adminAccess`` result owns nothing (module docstring, "adminAccess")."""
        out: dict[str, tuple[ClaimRecord, PreparedDevice]] = {}
        for rec in self.checkpoint:
            for d in rec.devices:
                if d.gpu == gpu and not d.admin_access:
                    out[d.uuid] = (rec, d)
        return out

    def _instances(self, gpu: int) -> list[tuple[GpuInstanceInfo, str]]:
        """GPU instances with the UUID of their MIG device (``""`` without a compute instance)."""
        nv = self._nvml
        uuids: dict[int, str] = {}
        for d in nv.mig_devices(gpu):
            uuids.setdefault(d.gi_id, d.uuid)
        return [(gi, uuids.get(gi.gi_id, "")) for gi in nv.gpu_instances(gpu)]

    def _busy(self, gpu: int, gi: GpuInstanceInfo | None = None) -> list[int]:
        if gi is not None and not gi.compute_instances:
            return []
        return workload(self._nvml, gpu, None if gi is None else gi.gi_id)

    # -- instance operations ---------------------------------------------------------------

    def _destroy(self, gpu: int, gi: GpuInstanceInfo) -> None:
        nv = self._nvml
        for ci in gi.compute_instances:
            try:
                nv.destroy_compute_instance(gpu, gi.gi_id, ci)
            except NvmlError as e:
                if e.code != NvmlErrorCode.NOT_FOUND:
                    raise
        try:
            nv.destroy_gpu_instance(gpu, gi.gi_id)
        except NvmlError as e:
            if e.code != NvmlErrorCode.NOT_FOUND:
                raise
        finally:
            self._gi_changed_now(gpu, gi.gi_id)  # the driver reuses the id

    def _set_mig(self, info: GpuInfo, enabled: bool) -> None:
        nv = self._nvml
        g = info.index
        if info.mig_enabled == enabled and not info.mig_pending:
            return
        busy = self._busy(g)
        if busy:
            raise ClaimError(
                f"GPU {g}: MIG mode must be {'enabled' if enabled else 'disabled'} but processes "
                f"run on the GPU outside any claim (pids {_pids(busy)})"
            )
        if enabled and info.compute_mode != ComputeMode.DEFAULT:
            nv.set_compute_mode(g, ComputeMode.DEFAULT)
        pending = self._mig_activation(g, enabled, nv.set_mig_mode(g, enabled))
        if pending:
            try:
                nv.reset_gpu(g)
            except NvmlError as e:
                remedy = RESET_REMEDY.get(e.code)
                raise ClaimError(
                    f"GPU {g}: MIG mode {'enable' if enabled else 'disable'} waits for a GPU "
                    f"reset, which failed ({e}); "
                    + (
                        remedy.format(gpu=g, bus=info.pci_bus_id or g)
                        if remedy is not None
                        else "give the agent nvidia-smi, or stop what holds the GPU "
                        "(nvidia-persistenced, DCGM), or reboot the node"
                    )
                ) from None
        if self._info(g).mig_enabled != enabled:
            raise ClaimError(f"GPU {g}: MIG mode is still {'off' if enabled else 'on'}")

    def _mig_activation(self, g: int, enabled: bool, status: NvmlErrorCode | None) -> bool:
        """:func:`node_agent.reconciler.mig_activation`: ``False`` the mode is current,
        ``True`` it is pending a GPU reset; neither raises :class:`ClaimError` (the kubelet
        retries the prepare, the next round the planned placement)."""
        pending = mig_activation(self._nvml, g, enabled, status)
        if pending is None:
            assert status is not None
            raise ClaimError(
                f"GPU {g}: MIG mode {'enable' if enabled else 'disable'} was not activated (NVML "
                f"activation status {status.name}: the GPU is not idle); asked again at the "
                "next try"
            )
        return pending

    def _whole(self, t: DeviceTarget) -> tuple[str, str]:
        """Hand out GPU ``t.gpu`` whole; returns ``(device UUID, GPU UUID)`` (the same)."""
        g = t.gpu
        info = self._info(g)
        for owner, d in self._owners(g).values():  # this claim's own devices too
            raise ClaimError(f"GPU {g} holds {d.device} prepared for claim {owner.label()}")
        if info.mig_enabled or info.mig_pending:
            for gi, mig_uuid in self._instances(g) if info.mig_enabled else []:
                self._destroy_unknown(g, gi, mig_uuid)
            self._set_mig(self._info(g), False)
        return info.uuid, info.uuid

    def _placement(self, uid: str, t: DeviceTarget) -> tuple[str, str, bool]:
        """Create or adopt the instance of placement ``t`` for claim ``uid``; returns
        ``(MIG device UUID, GPU UUID, adopted)``: ``adopted`` when the instance was there,
        idle and owned by no one (a failed prepare leaves it so)."""
        nv = self._nvml
        g, p, start = t.gpu, t.profile, t.start
        assert p is not None
        everyone = self._owners(g)
        owners = {u: o for u, o in everyone.items() if o[0].uid != uid}
        mine = {u for u, o in everyone.items() if o[0].uid == uid}
        info = self._info(g)
        whole = everyone.get(info.uuid)  # this claim's own devices too
        if whole is not None:
            raise ClaimError(f"GPU {g} is prepared whole for claim {whole[0].label()}")
        if (rec := self._recorded_conflict(uid, t)) is not None:
            raise ClaimError(
                f"placement {p.name} at {start} on GPU {g} conflicts with the devices recorded "
                f"for claim {rec.label()} (the counters refuse both; its instances may be gone "
                "since a reboot, until it is prepared again or unprepared)"
            )
        if not info.mig_enabled:
            self._set_mig(info, True)
        span = set(p.span(start))
        exact: tuple[GpuInstanceInfo, str] | None = None
        for gi, mig_uuid in self._instances(g):
            if gi.start == start and gi.profile_id == p.profile_id:
                exact = (gi, mig_uuid)
                continue
            if not span & set(range(gi.start, gi.start + gi.size)):
                continue
            if mig_uuid in owners:
                raise ClaimError(
                    f"placement {p.name} at {start} on GPU {g} overlaps instance {mig_uuid} "
                    f"prepared for claim {owners[mig_uuid][0].label()}: the allocation "
                    "conflicts with a prepared claim (another tool may manage this GPU)"
                )
            if mig_uuid in mine:
                raise ClaimError(f"claim devices overlap on GPU {g} at {start}")
            self._destroy_unknown(g, gi, mig_uuid)
        if exact is not None:
            gi, mig_uuid = exact
            if mig_uuid in owners:
                raise ClaimError(
                    f"{p.name} at {start} on GPU {g} is prepared for claim "
                    f"{owners[mig_uuid][0].label()}"
                )
            busy = self._busy(g, gi)
            if busy:
                raise ClaimError(
                    f"{p.name} at {start} on GPU {g} runs processes outside any claim "
                    f"(pids {_pids(busy)})"
                )
            if not gi.compute_instances:
                nv.create_compute_instance(g, gi.gi_id)
            return self._uuid_of(g, gi.gi_id), info.uuid, True
        try:
            gi_id = nv.create_gpu_instance(g, p.profile_id, start, p.memory_slices)
            self._gi_changed_now(g, gi_id)
        except NvmlError as e:
            if e.code != NvmlErrorCode.INSUFFICIENT_RESOURCES:
                raise
            keep = set(owners) | mine
            for gi, mig_uuid in self._instances(g):
                if mig_uuid not in keep and not self._xid_keeps(g, gi):
                    self._destroy_unknown(g, gi, mig_uuid)
            gi_id = nv.create_gpu_instance(g, p.profile_id, start, p.memory_slices)
            self._gi_changed_now(g, gi_id)
        self._compute_on(g, gi_id)
        return self._uuid_of(g, gi_id), info.uuid, False

    def _as_it_is(self, t: DeviceTarget) -> tuple[str, str]:
        """The device of an ``adminAccess`` result as it is (module docstring, "adminAccess"):
        ``(device UUID, GPU UUID)`` of the whole GPU, whatever its mode, or of the MIG device
        at placement ``t``; nothing is created, destroyed or switched, and whoever holds the
        device keeps it.  No such MIG device raises :class:`ClaimError`."""
        g, p = t.gpu, t.profile
        info = self._info(g)
        if p is None:
            return info.uuid, info.uuid
        if info.mig_enabled:
            for gi, mig_uuid in self._instances(g):
                if gi.start == t.start and gi.profile_id == p.profile_id and mig_uuid:
                    return mig_uuid, info.uuid
        where = "MIG mode is off" if not info.mig_enabled else "no MIG device is there"
        raise ClaimError(
            f"adminAccess to placement {p.name} at {t.start} on GPU {g}: {where}, and admin "
            "access is given to a device as it is, never creating one; the kubelet retries "
            "(it succeeds once a claim's instance, or a planned one, is there)"
        )

    def _recorded_conflict(self, uid: str, t: DeviceTarget) -> ClaimRecord | None:
        """Another claim's record whose devices on ``t``'s GPU the ResourceSlice counters
        (:func:`~node_agent.dra_slices.placement_counters`) refuse beside ``t``, else ``None``.
        The hardware checks of :meth:`_placement` see only the instances that exist: after a
        reboot a prepared claim's instances are gone until the kubelet prepares it again, and
        an allocation overlapping its placement (or taking the GPU's one ``+me``) would be
        made there and keep the claim from ever being prepared again
        (tests/test_agent_dra_faults.py); the checkpoint still says the placement is taken.
        Devices of ``adminAccess`` results are not counted: the scheduler does not either."""
        model = self.models[t.gpu]
        capacity = gpu_counters(model)
        used = dict(placement_counters(model, t.profile, t.start))
        for rec in self.checkpoint:
            if rec.uid == uid:
                continue
            for d in rec.devices:
                o = self.targets.get(d.device)
                if d.gpu != t.gpu or o is None or d.admin_access:
                    continue  # (an adminAccess device holds no counters)
                for k, v in placement_counters(model, o.profile, o.start).items():
                    used[k] = used.get(k, 0) + v
                if any(v > capacity.get(k, 0) for k, v in used.items()):
                    return rec
        return None

    def _compute_on(self, g: int, gi_id: int) -> None:
        """Create the compute instance of a new GPU instance; on failure destroy the GPU
        instance, so no half-made instance is left behind."""
        try:
            self._nvml.create_compute_instance(g, gi_id)
        except NvmlError as e:
            try:
                self._nvml.destroy_gpu_instance(g, gi_id)
            except NvmlError as undo:  # the cause stays the error; the leftover is named
                self._gi_changed_now(g, gi_id)
                raise NvmlError(
                    e.code,
                    e.op,
                    f"{e.detail}; destroying the half-made GPU instance {gi_id} failed too "
                    f"({undo}): the next round or prepare completes or removes it",
                ) from None
            self._gi_changed_now(g, gi_id)
            raise

    def _destroy_unknown(self, g: int, gi: GpuInstanceInfo, mig_uuid: str) -> None:
        busy = self._busy(g, gi)
        if busy:
            raise ClaimError(
                f"GPU {g}: instance {mig_uuid or gi.gi_id} at start {gi.start} is in the way and "
                f"runs processes outside any claim (pids {_pids(busy)}); it is "
                "never destroyed: end those processes"
            )
        log.info("GPU %d: destroying unknown idle MIG instance %s", g, mig_uuid or gi.gi_id)
        self._destroy(g, gi)

    def _uuid_of(self, g: int, gi_id: int) -> str:
        for d in self._nvml.mig_devices(g):
            if d.gi_id == gi_id:
                return d.uuid
        raise ClaimError(f"GPU {g}: GPU instance {gi_id} has no MIG device after creation")

    def _exists(self, d: PreparedDevice) -> bool:
        """Does prepared device ``d`` still exist?  An unreadable GPU raises
        :class:`GpuUnreadable` (unknown is not "gone": nothing is made again there)."""
        try:
            info = self._info(d.gpu)
            if d.profile is None:
                return info.uuid == d.uuid and not info.mig_enabled
            return info.mig_enabled and any(m.uuid == d.uuid for m in self._nvml.mig_devices(d.gpu))
        except GpuUnreadable:
            raise
        except NvmlError as e:
            raise _isolated(d.gpu, e) from None
        except ClaimError:  # the GPU is gone from the node
            return False

    def _destroy_devices(
        self,
        label: str,
        devices: Sequence[PreparedDevice],
        *,
        check_busy: bool,
        keep: Collection[str] = (),
    ) -> None:
        """Destroy the MIG instances of ``devices``: with ``check_busy``, all idle or none
        (raises); without, the idle ones (a used one is kept and logged).  Idle instances of
        devices named in ``keep`` (planned placements) are left in place, owned by no one.  A
        GPU of ``devices`` that NVML cannot read raises :class:`GpuUnreadable` before anything
        is destroyed.  Devices of ``adminAccess`` results are left out: never destroyed, never
        waited for (module docstring, "adminAccess")."""
        devices = [d for d in devices if not d.admin_access]
        self._check_readable(d.gpu for d in devices)
        found: list[tuple[int, GpuInstanceInfo, bool]] = []  # (GPU, instance, kept if idle)
        for d in devices:
            info = self._info(d.gpu)
            if d.profile is None:
                busy = self._busy(d.gpu) if check_busy and not info.mig_enabled else []
                if busy:
                    raise ClaimError(
                        f"claim {label}: GPU {d.gpu} still runs processes (pids "
                        f"{_pids(busy)}); retried once they end"
                    )
                continue
            if not info.mig_enabled:
                continue
            for gi, mig_uuid in self._instances(d.gpu):
                if mig_uuid == d.uuid:
                    found.append((d.gpu, gi, d.device in keep))
        if check_busy:
            for g, gi, _ in found:
                busy = self._busy(g, gi)
                if busy:
                    raise ClaimError(
                        f"claim {label}: its instance on GPU {g} at start {gi.start} still runs "
                        f"processes (pids {_pids(busy)}); retried once they end"
                    )
        for g, gi, planned in found:
            if not check_busy and self._busy(g, gi):
                log.warning("claim %s: instance on GPU %d runs processes; kept", label, g)
                continue
            if self._xid_keeps(g, gi):
                log.info(
                    "claim %s: kept its instance on GPU %d at start %d, idle: an XID hit it "
                    "(nothing an XID hit is destroyed until the agent restarts)",
                    label,
                    g,
                    gi.start,
                )
                continue
            if planned:
                log.info(
                    "claim %s: kept its idle instance on GPU %d at start %d (a planned "
                    "placement: the next claim allocated it adopts it)",
                    label,
                    g,
                    gi.start,
                )
                continue
            self._destroy(g, gi)

    def _release(self, rec: ClaimRecord, *, check_busy: bool, keep_planned: bool = False) -> None:
        """Destroy the record's MIG instances (see :meth:`_destroy_devices`; with
        ``keep_planned``, idle ones at :attr:`planned` placements stay) and forget it."""
        keep = self.planned if keep_planned and self.planned is not None else ()
        self._destroy_devices(rec.label(), rec.devices, check_busy=check_busy, keep=keep)
        if self.cdi_dir is not None:
            remove_spec(self.cdi_dir, rec.uid, self.driver)
        self.checkpoint.drop(rec.uid)

    # -- the API -----------------------------------------------------------------------

    def prepare(self, ref: ClaimRef, devices: Sequence[AllocatedDevice]) -> list[PreparedDevice]:
        """Prepare the claim's devices (module docstring); raises :class:`ClaimError`."""
        with self._lock:
            try:
                return self._prepare(ref, devices)
            except (GpuUnreadable, NvmlError) as e:  # GpuUnreadable: raised before the record
                raise ClaimError(f"{ref}: {e}") from None

    def _prepare(self, ref: ClaimRef, devices: Sequence[AllocatedDevice]) -> list[PreparedDevice]:
        for a in devices:
            if a.device not in self.targets:
                raise ClaimError(f"{ref}: device {a.device} is not a device of this node")
        self._check_readable(self.targets[a.device].gpu for a in devices)
        wanted = sorted((d.request, d.device, d.admin_access) for d in devices)
        old = self.checkpoint.get(ref.uid)
        keep: list[PreparedDevice] = []
        if old is not None:
            have = sorted((d.request, d.device, d.admin_access) for d in old.devices)
            if old.state == "completed" and have == wanted:
                missing = [d for d in old.devices if not self._exists(d)]
                if not missing:  # prepared before any XID: its pod keeps it
                    self._write_cdi(old)
                    return list(old.devices)
                self._refuse_xid(ref, devices)
                log.warning(
                    "claim %s: %d prepared device(s) are gone (reboot?); preparing them again",
                    old.label(),
                    len(missing),
                )
                keep = [d for d in old.devices if d not in missing]
            else:
                self._refuse_xid(ref, devices)
                self._release(old, check_busy=old.state == "completed", keep_planned=True)
                old = None
        else:
            self._refuse_xid(ref, devices)
        rec = ClaimRecord(ref.namespace, ref.name, ref.uid, "started", list(keep))
        self.checkpoint.put(rec)
        kept = {d.device for d in keep}
        todo = sorted(
            (a for a in devices if a.device not in kept),
            key=lambda a: (
                a.admin_access,  # last: an admin device of the claim's own is there by then
                self.targets[a.device].gpu,
                -(p.memory_slices if (p := self.targets[a.device].profile) else 99),
                a.device,
            ),
        )
        created: list[PreparedDevice] = []
        adopted: set[str] = set()  # instances this call found idle and took: left at a rollback
        try:
            for a in todo:
                t = self.targets[a.device]
                try:
                    if a.admin_access:
                        uuid, gpu_uuid = self._as_it_is(t)
                    elif t.profile is None:
                        uuid, gpu_uuid = self._whole(t)
                    else:
                        uuid, gpu_uuid, took = self._placement(ref.uid, t)
                        if took:
                            adopted.add(a.device)
                except NvmlError as e:
                    raise ClaimError(f"GPU {t.gpu}: {e}") from None
                made = PreparedDevice(
                    request=a.request,
                    device=a.device,
                    gpu=t.gpu,
                    gpu_uuid=gpu_uuid,
                    profile=None if t.profile is None else t.profile.name,
                    start=t.start,
                    uuid=uuid,
                    cdi_id=cdi_device_id(ref.uid, a.device, self.driver),
                    share_id=a.share_id,
                    admin_access=a.admin_access,
                )
                created.append(made)
                rec.devices.append(made)
                self.checkpoint.put(rec)
            self._write_cdi(rec)
        except (ClaimError, NvmlError, OSError) as e:
            # OSError: the CDI spec or the checkpoint could not be written (a full or
            # read-only disk): rolled back like any failure, and told as this claim's
            if isinstance(e, OSError):
                e = ClaimError(f"{ref}: writing {getattr(e, 'filename', None) or 'a file'}: {e}")
            try:
                self._destroy_devices(rec.label(), created, check_busy=False, keep=adopted)
            except (ClaimError, NvmlError) as undo:  # the kubelet is told the cause, not this
                cause = str(e) if str(ref) in str(e) else f"{ref}: {e}"
                raise ClaimError(
                    f"{cause}; rolling back what this prepare made failed too ({undo}): "
                    "the claim's record stays 'started' and is rolled back at its next "
                    "prepare or the agent's next start"
                ) from None
            if old is not None:
                self.checkpoint.put(old)  # the devices still there stay this claim's
            else:
                with contextlib.suppress(OSError):  # the cause is told, not this
                    if self.cdi_dir is not None:
                        remove_spec(self.cdi_dir, rec.uid, self.driver)
                    self.checkpoint.drop(rec.uid)
            if isinstance(e, ClaimError):
                raise ClaimError(str(e) if str(ref) in str(e) else f"{ref}: {e}") from None
            raise
        rec.state = "completed"
        self.checkpoint.put(rec)
        return list(rec.devices)

    def _write_cdi(self, rec: ClaimRecord) -> None:
        if self.cdi_dir is None:
            return
        once: dict[str, tuple[str, str, str]] = {}  # a device two results name: one CDI device
        for d in rec.devices:
            once.setdefault(d.device, (d.request, d.device, d.uuid))
        spec = cdi_spec(rec.uid, list(once.values()), self.driver)
        write_spec(self.cdi_dir, rec.uid, spec, self.driver)

    def unprepare(self, uid: str) -> None:
        """Release what was prepared for claim ``uid`` (module docstring)."""
        with self._lock:
            rec = self.checkpoint.get(uid)
            if rec is None:
                return
            try:
                self._release(rec, check_busy=True, keep_planned=True)
            except (GpuUnreadable, NvmlError) as e:
                raise ClaimError(f"claim {rec.label()}: {e}") from None

    def clean_unknown(self) -> list[str]:
        """At start: roll back ``started`` records, destroy idle unknown instances (with
        :attr:`planned` set, those at planned placements stay); return what was kept (used
        unknown instances), one line each.  An unreadable GPU is skipped, its ``started``
        records kept (the claim's next prepare, or the next start, rolls them back); so is a
        record whose roll-back NVML refuses (a destroy failing: raising would fail every start
        of the agent, a crash loop), logged.  NVML itself down raises."""
        kept: list[str] = []
        with self._lock:
            for rec in self.checkpoint:
                if rec.state == "started":
                    try:
                        # planned placements' instances stay, idle (the record does not say
                        # which it adopted; unprepare keeps them too)
                        self._release(rec, check_busy=False, keep_planned=True)
                    except NvmlError as e:
                        if e.code in NVML_DOWN:
                            raise
                        log.warning(
                            "claim %s was being prepared when the agent stopped; rolling it "
                            "back failed (tried again at its next prepare or the next start): %s",
                            rec.label(),
                            e,
                        )
                        continue
                    except GpuUnreadable as e:
                        log.warning(
                            "claim %s was being prepared when the agent stopped; not rolled "
                            "back yet: %s",
                            rec.label(),
                            e,
                        )
                        continue
                    log.warning(
                        "claim %s was being prepared when the agent stopped; rolled back",
                        rec.label(),
                    )
            self._sweep(self.planned, kept)
        return kept

    def create_planned(
        self,
        planned: Collection[str],
        allocated: Collection[str] = (),
        skip: Collection[int] = (),
    ) -> int:
        """:meth:`make_planned`, returning how many instances it created."""
        return self.make_planned(planned, allocated, skip).created

    def make_planned(
        self,
        planned: Collection[str],
        allocated: Collection[str] = (),
        skip: Collection[int] = (),
    ) -> PlannedOutcome:
        """Create the instances of the planned placements (device names) that have none, on
        GPUs in MIG mode or idle ones (switched to MIG), where no instance and no allocated
        device overlaps the placement (shaped publishing, each round, after
        :meth:`destroy_idle`).  A placement that cannot be made now is logged and returned in
        :attr:`PlannedOutcome.unmade`, with why: the GPU's MIG mode could not be switched on
        (its other placements are then not tried this round: they would fail the same way) or
        the creation failed; prepare tries again, and so does the next round.  The GPUs in
        ``skip`` (unreadable this round) are not touched; one that turns unreadable meanwhile
        is left to the next round's :meth:`unreadable`."""
        created = 0
        mode_failed: dict[int, str] = {}
        failed: dict[str, str] = {}
        unmade: set[str] = set()
        with self._lock:
            spans: dict[int, set[int]] = {}
            for name in allocated:
                t = self.targets.get(name)
                if t is None:
                    continue
                if t.profile is None:
                    spans.setdefault(t.gpu, set()).update(range(64))
                else:
                    spans.setdefault(t.gpu, set()).update(t.profile.span(t.start))
            wanted = sorted(
                (t.gpu, t.start, name)
                for name in planned
                if (t := self.targets.get(name)) is not None
                and t.profile is not None
                and t.gpu not in skip
                and self.xid_mark_of(name) is None  # nothing is made where an XID hit
            )
            for g, _start, name in wanted:
                t = self.targets[name]
                p = t.profile
                assert p is not None
                span = set(p.span(t.start))
                if span & spans.get(g, set()):
                    continue  # an allocated device there: made by prepare once it is gone
                if g in mode_failed:
                    unmade.add(name)
                    continue
                try:
                    info = self._info(g)
                    if any(d.uuid == info.uuid for _, d in self._owners(g).values()):
                        continue  # prepared whole for a claim
                    if not info.mig_enabled:
                        try:
                            self._set_mig(info, True)
                        except GpuUnreadable:
                            raise
                        except (ClaimError, NvmlError) as e:
                            log.warning(
                                "GPU %d: planned placements not created now (prepare will "
                                "fail the same way): %s",
                                g,
                                e,
                            )
                            mode_failed[g] = str(e)
                            unmade.add(name)
                            continue
                    instances = self._instances(g)
                    half = [
                        gi
                        for gi, _ in instances
                        if (gi.start, gi.profile_id) == (t.start, p.profile_id)
                        and not gi.compute_instances
                    ]
                    if half:
                        # a GPU instance without its compute instance (a creation that failed
                        # half-way, and whose rollback failed too) is completed, else it stays
                        # half-made for ever: "there already" below, kept as planned by the
                        # clean-ups (tests/test_agent_dra_faults.py)
                        self._nvml.create_compute_instance(g, half[0].gi_id)
                    elif any(
                        span & set(range(gi.start, gi.start + gi.size)) for gi, _ in instances
                    ):
                        continue  # there already, or something in the way
                    else:
                        gi_id = self._nvml.create_gpu_instance(
                            g, p.profile_id, t.start, p.memory_slices
                        )
                        self._gi_changed_now(g, gi_id)
                        self._compute_on(g, gi_id)
                except GpuUnreadable as e:
                    log.warning("planned placement %s not created now: %s", name, e)
                    continue
                except (ClaimError, NvmlError) as e:
                    log.warning("planned placement %s not created now (prepare will): %s", name, e)
                    failed[name] = str(e)
                    unmade.add(name)
                    continue
                created += 1
            modes = self._mig_modes()
        return PlannedOutcome(created, mode_failed, failed, frozenset(unmade), modes)

    def _mig_modes(self) -> dict[int, bool]:
        """The MIG mode of every GPU served here that NVML reads now (a failed listing: none)."""
        try:
            listed = self._nvml.gpus(isolate=True)
        except NvmlError:
            return {}
        return {
            i.index: i.mig_enabled
            for i in listed
            if i.index in self.models and i.read_error is None
        }

    def destroy_idle(self, keep: Collection[str], skip: Collection[int] = ()) -> int:
        """Destroy every idle MIG instance no claim owns whose placement (device name) is not
        in ``keep``, except on the GPUs in ``skip`` (unreadable this round); return how many
        (shaped publishing, each round)."""
        with self._lock:
            return self._sweep(keep, [], skip)

    def _sweep(
        self, keep: Collection[str] | None, kept: list[str], skip: Collection[int] = ()
    ) -> int:
        """Destroy the idle unknown instances outside ``keep`` GPU by GPU; a GPU in ``skip``,
        or one whose reads fail (:class:`GpuUnreadable`), is left as it is and the others go
        on.  NVML down raises."""
        destroyed = 0
        try:
            listed = self._nvml.gpus(isolate=True)
        except NvmlError as e:
            if e.code in NVML_DOWN:
                raise
            log.warning("listing the GPUs failed: %s; idle MIG instances are left for now", e)
            return 0
        for g, model in self.models.items():
            if g in skip or not model.mig_capable:
                continue
            try:
                info = self._info(g, listed)
                if not info.mig_enabled:
                    continue
                self._probe(info)
                destroyed += self._sweep_gpu(g, model, keep, kept)
            except GpuUnreadable as e:
                log.warning("%s; its idle MIG instances are left for now", e)
            except NvmlError as e:  # e.g. a destroy refused: the other GPUs go on
                if e.code in NVML_DOWN:
                    raise
                log.warning("GPU %d: removing idle MIG instances failed: %s", g, e)
        return destroyed

    def _sweep_gpu(
        self, g: int, model: GpuModel, keep: Collection[str] | None, kept: list[str]
    ) -> int:
        destroyed = 0
        owners = self._owners(g)
        for gi, mig_uuid in self._instances(g):
            if mig_uuid and mig_uuid in owners:
                continue
            if keep is not None and _placement(g, model, gi) in keep:
                continue
            if self._xid_keeps(g, gi):
                continue  # an XID hit it: left as it is until the agent restarts
            if self._busy(g, gi):
                kept.append(
                    f"GPU {g}: instance {mig_uuid or gi.gi_id} at start {gi.start} runs processes"
                )
                continue
            log.info("GPU %d: destroying unknown idle MIG instance %s", g, mig_uuid or gi.gi_id)
            self._destroy(g, gi)
            destroyed += 1
        return destroyed

    def foreign_use(self, skip: Collection[int] = ()) -> list[ForeignUse]:
        """The placements (or whole GPUs) that run processes outside any claim now
        (:mod:`node_agent.dra_foreign`), GPU by GPU; the GPUs in ``skip`` (unreadable this
        round) and those gone from the node are left out, NVML itself down raises.  A GPU not
        in ``skip`` whose reads fail now (an error since the round's :meth:`unreadable`, or a
        transient one) is returned as used whole, with no pid: its processes are unknown, so
        none of its free devices may be published and nothing planned is made on it this
        round.  (Leaving it out published the free devices around a process outside any
        claim: tests/test_agent_dra_faults.py.)  Reads NVML: called from a worker thread."""
        out: list[ForeignUse] = []
        with self._lock:
            try:
                listed = self._nvml.gpus(isolate=True)
            except NvmlError as e:
                if e.code in NVML_DOWN:
                    raise
                log.warning("listing the GPUs failed (%s); every GPU taken as used whole", e)
                return [ForeignUse(g, "", ()) for g in sorted(self.models) if g not in skip]
            for g, model in sorted(self.models.items()):
                if g in skip:
                    continue
                try:
                    out.extend(self._foreign_on(g, model, listed))
                except GpuUnreadable as e:
                    log.warning("GPU %d: processes unknown (%s); taken as used whole", g, e)
                    out.append(ForeignUse(g, "", ()))
                except ClaimError:
                    continue  # gone from the node
                except NvmlError as e:
                    if e.code in NVML_DOWN:
                        raise
                    log.warning("GPU %d: processes unknown (%s); taken as used whole", g, e)
                    out.append(ForeignUse(g, "", ()))
        return out

    def _foreign_on(self, g: int, model: GpuModel, listed: Sequence[GpuInfo]) -> list[ForeignUse]:
        info = self._info(g, listed)
        owners = self._owners(g)
        if info.uuid in owners:
            return []  # prepared whole for a claim: its processes are the claim's
        if not info.mig_enabled:
            busy = self._busy(g)
            return [ForeignUse(g, "", tuple(busy))] if busy else []
        out: list[ForeignUse] = []
        for gi, mig_uuid in self._instances(g):
            if mig_uuid and mig_uuid in owners:
                continue
            busy = self._busy(g, gi)
            if busy:
                out.append(ForeignUse(g, _placement(g, model, gi) or "", tuple(busy)))
        return out

    def prepared(self) -> Mapping[str, ClaimRecord]:
        return {r.uid: r for r in self.checkpoint}


def _placement(g: int, model: GpuModel, gi: GpuInstanceInfo) -> str | None:
    """The device name of instance ``gi``'s placement (``None``: a profile the catalog lacks)."""
    try:
        return device_name(g, model.profile_by_id(gi.profile_id), gi.start)
    except ValueError:
        return None


def _pids(pids: Sequence[int]) -> str:
    """The first pids of a list, for a message."""
    return ", ".join(map(str, pids[:8]))
