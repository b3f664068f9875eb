"""The pure diff of one GPU: observed state + desired spec -> the safe operations to run.

Model
-----
:class:`ObservedGpu` is what the agent read this pass: NVML facts (MIG mode, GPU instances with
placement, compute instances and MIG UUID, processes) joined with the kubelet's in-use device
ids, plus the agent's MPS slice table.  An instance or slice is *used* when a pod holds its
device id or a process runs on it.  :func:`plan_gpu` returns a :class:`GpuPlan`, decided in this
order, so a spec that cannot be applied touches nothing:

1. **validate** the whole target against the catalog (known model and profiles, a valid
   layout per :func:`planner.geometry.layout_errors`, MPS slices that fit the GPU memory,
   at most :data:`planner.mps.MAX_CLIENTS` (48, an MPS server's client limit) per GPU or
   instance unless it holds that many already);
   failure -> ``blocked`` (Degraded), no operation.
2. **protect** every used instance/slice: it must be part of the target exactly (same profile
   at the same start; same memory and thread share), and a MIG mode change needs the GPU idle;
   otherwise -> ``blocked`` (Degraded) with the device named, no operation.
3. **diff**: destroy the free instances not wanted (CI before GI, done by the executor), switch
   MIG mode if needed, create the wanted instances missing at their exact starts (plus the CI of
   a wanted GI left without one), and rebuild the MPS slice table (keep matched slices, drop
   free unmatched ones, add missing ones with fresh slot numbers).  MIG mode is right only when
   it is current *and* no change is pending (Ampere, until a GPU reset): a change pending
   towards the wanted mode is planned as that switch (the executor only has to reset), one
   pending away from it is cancelled by asking for the current mode.

When the kubelet's in-use ids could not be read, every device counts as used; a plan that would
then be blocked is reported as ``waiting`` (transient, retried) instead of Degraded.

A GPU instance with several compute instances (*split*: made by an admin or another tool;
gpuslice makes one CI per GI) is used when a pod holds any of its CIs' MIG devices; it matches
no spec entry, so it is destroyed once free (and re-created whole if the spec wants its
placement) and, while used, blocks the GPU (``InstanceInUse``, naming it).

**Hybrid** (``mode: hybrid``): an instance may host MPS slices (``spec.gpus[].mig[].mps``).
Each instance has its own slice table (:attr:`ObservedInstance.slices`, slice ids built on the
MIG device's UUID, so they name the instance).  An instance holding a used slice is used
itself: never destroyed nor moved.  Validation adds: slices only in hybrid mode, at least 1024
MiB each, the slices of one instance within its profile's memory.  For every kept instance the
slice table is diffed like a whole GPU's (:func:`diff_slices`: used slices must stay, free ones
not wanted go, missing ones get fresh slot numbers) into :attr:`GpuPlan.hosted`; the tables of
instances created in this pass are filled by the reconciler once their UUID is known.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from contract.nodepartitioning import DesiredGpu
from node_agent.devices import mps_slice_id
from node_agent.nvml import GpuInfo
from planner.catalog import CatalogError, GpuModel, MigProfile
from planner.geometry import Placement, layout_errors
from planner.mps import MAX_CLIENTS

__all__ = [
    "Block",
    "GpuPlan",
    "MpsSlot",
    "ObservedGpu",
    "ObservedInstance",
    "diff_slices",
    "plan_gpu",
]


@dataclass(frozen=True, slots=True)
class ObservedInstance:
    """One GPU instance as read from NVML, with its in-use facts."""

    gi_id: int
    profile_id: int
    profile: MigProfile | None
    """``None`` when the profile id is not in the catalog for this model."""
    start: int
    size: int
    ci_ids: tuple[int, ...]
    uuid: str
    """MIG device UUID of its (first) compute instance; ``""`` if it has no CI."""
    in_use: bool
    """A pod holds the MIG device -- any of its compute instances' (PodResources) --, or in-use
    ids are unknown."""
    busy: bool
    """Processes run on it."""
    slices: tuple[MpsSlot, ...] | None = ()
    """Hybrid: the MPS slices it hosts (``None``: the table is unknown after a restart)."""
    used_slices: frozenset[str] = frozenset()
    """Ids of its slices that pods hold."""
    other_uuids: tuple[str, ...] = ()
    """MIG device UUIDs of its further compute instances (:attr:`split`)."""

    @property
    def split(self) -> bool:
        """It has several compute instances (another tool made them; gpuslice makes one per
        instance): it matches no spec entry, is not advertised, and is destroyed once free."""
        return len(self.ci_ids) > 1

    @property
    def used(self) -> bool:
        """A pod holds it or one of its slices, or processes run on it."""
        return self.in_use or self.busy or bool(self.used_slices)

    @property
    def name(self) -> str:
        return self.profile.name if self.profile else f"profile-id-{self.profile_id}"

    def __str__(self) -> str:
        uuids = ", ".join(u for u in (self.uuid, *self.other_uuids) if u)
        return f"{self.name}@{self.start}" + (f" ({uuids})" if uuids else "")


@dataclass(frozen=True, slots=True)
class MpsSlot:
    """One MPS slice the agent advertises on a GPU."""

    slot: int
    memory_mib: int
    thread_percentage: int
    device_id: str


@dataclass(frozen=True, slots=True)
class ObservedGpu:
    info: GpuInfo
    model: GpuModel | None
    instances: tuple[ObservedInstance, ...]
    gpu_processes: int
    """Processes on the GPU as a whole (MPS clients, or anything with MIG off)."""
    slices: tuple[MpsSlot, ...] | None
    """The MPS slice table; ``None`` when unknown (agent restarted, in-use ids unreadable)."""
    used_slices: frozenset[str]
    in_use_known: bool


@dataclass(frozen=True, slots=True)
class Block:
    """Why a GPU's spec cannot be applied (Degraded) -- or, if ``transient``, not yet."""

    reason: str
    message: str
    transient: bool = False


@dataclass(frozen=True, slots=True)
class GpuPlan:
    gpu: int
    destroy: tuple[ObservedInstance, ...] = ()
    create_ci: tuple[ObservedInstance, ...] = ()
    mig_mode: bool | None = None
    """Switch MIG mode to this (after the destroys, before the creates)."""
    create: tuple[Placement, ...] = ()
    slices: tuple[MpsSlot, ...] | None = None
    """The new MPS slice table; ``None`` = leave it as it is."""
    hosted: tuple[tuple[str, tuple[MpsSlot, ...]], ...] = ()
    """Hybrid: (MIG UUID, its new slice table) of every kept instance whose table changes."""
    block: Block | None = None

    def is_noop(self) -> bool:
        return (
            not self.destroy
            and not self.create_ci
            and self.mig_mode is None
            and not self.create
            and self.slices is None
            and not self.hosted
        )


def _blocked(obs: ObservedGpu, reason: str, message: str) -> GpuPlan:
    i = obs.info.index
    if not obs.in_use_known and reason in ("InstanceInUse", "SliceInUse", "GpuBusy"):
        return GpuPlan(
            i,
            block=Block(
                "InUseUnknown",
                f"GPU {i}: kubelet in-use device ids unavailable; not changing it ({message})",
                transient=True,
            ),
        )
    return GpuPlan(i, block=Block(reason, f"GPU {i}: {message}"))


def _target_layout(obs: ObservedGpu, desired: DesiredGpu) -> tuple[tuple[Placement, ...], str]:
    model = obs.model
    assert model is not None
    try:
        target = tuple(Placement(d.start, model.profile(d.profile)) for d in desired.mig)
    except CatalogError as e:
        return (), f"UnknownProfile: {e}"
    errs = layout_errors(model, target)
    if errs:
        return (), "InvalidLayout: " + "; ".join(errs)
    return target, ""


def plan_gpu(obs: ObservedGpu, desired: DesiredGpu, mode: str) -> GpuPlan:
    """The operations that move GPU ``obs`` to ``desired`` in ``mode`` (see module docstring)."""
    i = obs.info.index
    if obs.model is None:
        return _blocked(
            obs,
            "UnknownGpuModel",
            f"{obs.info.name} (PCI {obs.info.pci_device_id}) is not in the GPU catalog; add it "
            "with a catalog override file (GPUSLICE_CATALOG_FILES)",
        )
    if mode == "mps":
        return _plan_mps(obs, desired)
    if not obs.model.mig_capable:
        return _blocked(obs, "MigNotSupported", f"{obs.model.name} does not support MIG")
    if desired.mps:
        return _blocked(
            obs, "InvalidSpec", f"MPS slices are listed but the node's mode is {mode!r}"
        )
    target, err = _target_layout(obs, desired)
    if err:
        reason, _, msg = err.partition(": ")
        return _blocked(obs, reason, msg)
    hosting = {(x.profile.name, x.start): len(x.slices or ()) for x in obs.instances if x.profile}
    hosted_err = _hosted_errors(obs.model, desired, mode, hosting)
    if hosted_err:
        return _blocked(obs, "InvalidSpec", hosted_err)

    if not obs.info.mig_enabled:
        used = _used_slices(obs)
        if used or obs.gpu_processes or obs.slices is None:
            what = ", ".join(used) or f"{obs.gpu_processes} process(es)"
            if obs.slices is None:
                return _blocked(obs, "GpuBusy", "MPS slices unknown")
            return _blocked(obs, "GpuBusy", f"MIG mode is off and the GPU is in use ({what})")
        return GpuPlan(i, mig_mode=True, create=target, slices=() if obs.slices else None)

    wanted = {(p.profile.profile_id, p.start): p for p in target}
    want_slices = {
        (p.profile.profile_id, p.start): [(s.memoryMiB, s.activeThreadPercentage) for s in d.mps]
        for p, d in zip(target, desired.mig, strict=True)
    }
    keep: set[tuple[int, int]] = set()
    destroy: list[ObservedInstance] = []
    create_ci: list[ObservedInstance] = []
    conflicts: list[str] = []
    hosted: list[tuple[str, tuple[MpsSlot, ...]]] = []
    for inst in obs.instances:
        key = (inst.profile_id, inst.start)
        if key in wanted and key not in keep and not inst.split:
            keep.add(key)
            if not inst.ci_ids:
                create_ci.append(inst)
            if want_slices[key] and inst.in_use and not inst.slices:
                return _blocked(
                    obs,
                    "InstanceInUse",
                    f"{inst} is in use as a whole MIG device; it cannot host MPS slices",
                )
            if inst.slices is None:
                if want_slices[key] or inst.used:
                    return _blocked(obs, "SliceInUse", f"MPS slice table of {inst} unknown")
                continue
            table, in_the_way = diff_slices(
                inst.slices, inst.used_slices, want_slices[key], inst.uuid
            )
            if in_the_way:
                return _blocked(
                    obs,
                    "SliceInUse",
                    f"in-use MPS slice(s) {', '.join(in_the_way)} of {inst} are not in the spec; "
                    "they are kept and the spec is not applied",
                )
            if table is not None and inst.uuid:
                hosted.append((inst.uuid, table))
        elif inst.used:
            conflicts.append(str(inst))
        else:
            destroy.append(inst)
    split = [str(x) for x in obs.instances if x.split and x.used]
    if split:
        return _blocked(
            obs,
            "InstanceInUse",
            f"in-use instance(s) {', '.join(split)} have several compute instances (made "
            "outside gpuslice, which uses one per instance); they are kept, not advertised, "
            "and the spec is not applied",
        )
    if conflicts:
        return _blocked(
            obs,
            "InstanceInUse",
            f"in-use instance(s) {', '.join(conflicts)} are not in the spec at the same "
            "profile and start; they are kept and the spec is not applied",
        )
    create = tuple(p for k, p in wanted.items() if k not in keep)
    return GpuPlan(
        i,
        destroy=tuple(destroy),
        create_ci=tuple(create_ci),
        mig_mode=True if obs.info.mig_pending else None,  # cancel a pending disable
        create=create,
        hosted=tuple(hosted),
    )


def _too_many_slices(wanted: int, now: int) -> str:
    """Why ``wanted`` MPS slices on one GPU (instance) holding ``now`` cannot be applied, or
    ``""``: more than :data:`planner.mps.MAX_CLIENTS`, unless it has that many already (an older
    plan made them; refusing would only block the GPU until their pods end)."""
    if wanted <= MAX_CLIENTS or wanted <= now:
        return ""
    return (
        f"{wanted} MPS slices listed, but an MPS server accepts at most {MAX_CLIENTS} clients "
        "(a pod's client past that fails CUDA init with cudaErrorMpsMaxClientsReached): at "
        f"most {MAX_CLIENTS} slices per GPU or instance"
    )


def _hosted_errors(
    model: GpuModel, desired: DesiredGpu, mode: str, now: Mapping[tuple[str, int], int]
) -> str:
    """Why the MPS slices inside ``desired``'s instances cannot be applied, or ``""``; ``now``
    counts the slices each (profile name, start) hosts now."""
    for d in desired.mig:
        if not d.mps:
            continue
        where = f"instance {d.profile}@{d.start}"
        if mode != "hybrid":
            return f"{where} lists MPS slices but the node's mode is {mode!r}"
        many = _too_many_slices(len(d.mps), now.get((model.profile(d.profile).name, d.start), 0))
        if many:
            return f"{where}: {many}"
        small = [s.memoryMiB for s in d.mps if s.memoryMiB < 1024]
        if small:
            return f"{where}: MPS slices under 1024 MiB ({small}) cannot be named"
        total = sum(s.memoryMiB for s in d.mps)
        memory = model.profile(d.profile).memory_mib
        if total > memory:
            return f"{where}: MPS slices need {total} MiB but the instance has {memory} MiB"
    return ""


def diff_slices(
    current: tuple[MpsSlot, ...],
    used: frozenset[str],
    desired: list[tuple[int, int]],
    id_base: str,
) -> tuple[tuple[MpsSlot, ...] | None, list[str]]:
    """The new slice table for ``desired`` (memory MiB, thread %) given the ``current`` one
    (``None``: unchanged), and the used slices the desired list lacks (then nothing changes).

    Used slices claim their desired twin first, so a free twin is the one dropped; new slices
    get the lowest free slot numbers and ids :func:`node_agent.devices.mps_slice_id` on
    ``id_base`` (the GPU's UUID, or the MIG device's for a slice inside an instance)."""
    want = Counter(desired)
    kept: list[MpsSlot] = []
    conflicts: list[str] = []
    for s in sorted(current, key=lambda s: s.device_id not in used):
        key = (s.memory_mib, s.thread_percentage)
        if want[key] > 0:
            want[key] -= 1
            kept.append(s)
        elif s.device_id in used:
            conflicts.append(s.device_id)
    if conflicts:
        return None, conflicts
    taken = {s.slot for s in kept}
    new = list(kept)
    slot = 0
    for (mem, pct), n in sorted(want.items()):
        for _ in range(n):
            while slot in taken:
                slot += 1
            taken.add(slot)
            new.append(MpsSlot(slot, mem, pct, mps_slice_id(id_base, slot, mem, pct)))
    new.sort(key=lambda s: s.slot)
    return (tuple(new) if tuple(new) != current else None), []


def _used_slices(obs: ObservedGpu) -> list[str]:
    if obs.slices is None:
        return []
    return [s.device_id for s in obs.slices if s.device_id in obs.used_slices]


def _plan_mps(obs: ObservedGpu, desired: DesiredGpu) -> GpuPlan:
    i = obs.info.index
    model = obs.model
    assert model is not None
    if desired.mig:
        return _blocked(obs, "InvalidSpec", "MIG instances are listed but the node's mode is 'mps'")
    many = _too_many_slices(len(desired.mps), len(obs.slices or ()))
    if many:
        return _blocked(obs, "InvalidSpec", many)
    total = sum(s.memoryMiB for s in desired.mps)
    if total > obs.info.memory_mib:
        return _blocked(
            obs,
            "InvalidSpec",
            f"MPS slices need {total} MiB but the GPU has {obs.info.memory_mib} MiB",
        )
    small = [s.memoryMiB for s in desired.mps if s.memoryMiB < 1024]
    if small:
        return _blocked(obs, "InvalidSpec", f"MPS slices under 1024 MiB ({small}) cannot be named")
    destroy: list[ObservedInstance] = []
    mig_mode: bool | None = None
    if obs.info.mig_enabled:
        used = [str(x) for x in obs.instances if x.used]
        if used:
            return _blocked(
                obs, "InstanceInUse", f"MIG instance(s) {', '.join(used)} in use; MPS needs MIG off"
            )
        destroy = list(obs.instances)
        mig_mode = False
    elif obs.info.mig_pending:
        mig_mode = False  # cancel a pending enable
    if obs.slices is None:
        return _blocked(obs, "SliceInUse", "MPS slice table unknown")
    slices, conflicts = diff_slices(
        obs.slices,
        obs.used_slices,
        [(s.memoryMiB, s.activeThreadPercentage) for s in desired.mps],
        obs.info.uuid,
    )
    if conflicts:
        return _blocked(
            obs,
            "SliceInUse",
            f"in-use MPS slice(s) {', '.join(conflicts)} are not in the spec; they are kept and "
            "the spec is not applied",
        )
    return GpuPlan(i, destroy=tuple(destroy), mig_mode=mig_mode, slices=slices)
