"""Slice accounting per node: what exists, what pods hold, what is promised, what is free. Pure.

Model
-----
For one GPU node (a :class:`NodeLedger`), per partitionable resource ``R``:

* ``total[R]`` — instances / MPS slices of ``R`` the node agent reports in the
  NodePartitioning ``status`` (the devices that exist), on GPUs that are not *frozen*;
* ``bound[R]`` — units of ``R`` held by pods bound to the node and not finished (from the pod
  objects, as kube-scheduler counts them; the agent's ``used`` flags lag by up to a resync),
  less the status-``used`` instances of ``R`` on frozen GPUs (those pods sit there);
* ``held[R]`` — units promised to pods that are not bound yet (reservations in state
  ``planned`` or ``released`` on this node, see :mod:`partitioner.reservations`);
* ``nominated[R]`` — units of pods kube-scheduler nominated the node for (it preempted pods
  there for them; they bind once the victims are gone), kept from everyone else as
  kube-scheduler keeps them from lower-priority pods;
* ``unhealthy[R]`` — devices of ``R`` the agent reports ``unhealthy`` (advertised Unhealthy:
  an XID error, a GPU NVML cannot read) that no pod uses: the kubelet gives them to no pod;
  and those it reports used that no bound pod can be holding (its pod left, the flag lags:
  :meth:`NodeLedger._sick_unheld`; on a DRA node those no claim is allocated);
* ``free[R] = total[R] - bound[R] - held[R] - nominated[R] - unhealthy[R]`` (never below 0):
  what a new reservation may take; on a device-plugin node where pods sit on unhealthy
  devices, at most what kube-scheduler admits, ``total[R] - sick[R] - bound[R] - held[R] -
  nominated[R]`` with ``sick`` every device reported unhealthy (allocatable lists only healthy
  ones, and those pods' requests count against it: :meth:`NodeLedger._admits_less`); the free
  devices beyond that are pinned for the planner.

A *frozen* GPU is being drained for a waiting pod: its free instances are neither counted nor
offered, and the planner does not see the GPU at all.

Holds that no longer fit (the node applied less than planned, is ``Degraded``, or a pod gpuslice
did not gate took a slice) are *broken*: :meth:`NodeLedger.settle` keeps holds in order
(released first, then priority, then age) while they fit and returns the rest.

For the planner (:meth:`NodeLedger.gpu_states`) an MPS GPU that is locked (unhealthy as a
whole) is left out as a frozen one is, and every instance a hold or a bound pod may be
using is pinned (``used``): one free instance of ``R`` per hold on the GPU the reservation
expects (else the lowest GPU with one; on a DRA node the first free ones in kube-scheduler's
allocation order, :func:`_allocation_order`, below), and, while pods bound to the node hold more units of
``R`` than the status shows used (the agent has not reported them yet), or while the pods
bound to the node changed after the agent's last report (a departed pod's device may still show
used and a new pod's not, with equal counts), or while, on a device-plugin node, ``R`` has an
unhealthy device shown used and a healthy foreign one (where only the flags would say which
device a new pod holds: :func:`_flags_decide`), every free instance of ``R`` that bound pods hold
— so no plan ever destroys a device that might be allocated — and one free instance of ``R``
per nominated unit (lowest GPU first), so the slice a preemption frees stays for its pod.

On a DRA node the reservation's GPU is not what the pod gets: kube-scheduler allocates a
claim the first published device of its profile whose counters fit, in its own order (no
device plugin's preferred allocation, no knowledge of the reservation).  So there a hold pins,
and a new reservation expects (:meth:`NodeLedger.choose_gpus`), the first free devices in that
order: a plan written while a released pod is not bound yet keeps the device it will be given.
(Pinned on the GPU the reservation expected, the first free one elsewhere stayed unpinned; a
plan repartitioned it, kube-scheduler gave it to the released pod from the slices the agent had
not narrowed yet, and the placement planned over it for another pod could not be made.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

from contract.dra_devices import placement_device_name
from contract.nodepartitioning import NodePartitioning
from partitioner.adoption import (
    Adopted,
    _is_shared,
    adopt,
    agent_reported,
    foreign_mode,
    gpus_from_status,
    other_model,
)
from partitioner.index import ClusterIndex, NodeInfo, PodInfo
from partitioner.node_labels import LabelProblem
from partitioner.reservations import Reservation, State
from partitioner.snapshot import NOS_AGENT_LABEL, GpuNode, NodeProblem
from planner.catalog import CatalogError, GpuModel
from planner.snapshot import (
    GpuState,
    MigInstance,
    Mode,
    MpsSlice,
    NodeState,
    mig_profile_of,
    mps_resource,
)

__all__ = ["Device", "GpuSlots", "Hold", "NodeLedger", "build_ledgers", "instance_resource"]

MIB_PER_GIB = 1024


def instance_resource(model: GpuModel, profile: str) -> str:
    """The extended resource a MIG instance of ``profile`` is advertised as."""
    try:
        return model.profile(profile).resource
    except CatalogError:
        return f"nvidia.com/mig-{profile}"


@dataclass(slots=True)
class Device:
    resource: str
    key: int
    """MIG start slot, or the MPS slice's position on its GPU."""
    compute: int
    used: bool
    """The agent reports it used (allocated to a pod, or running processes)."""
    pinned: bool = False
    """Used, or kept for a hold / a bound pod the status does not show yet."""
    mig_profile: str = ""
    memory_mib: int = 0
    thread_percentage: int | None = None
    guarded: bool = False
    """Free, but kept from plans while a released pod of its resource is unbound (the kubelet
    may give it that one: :meth:`NodeLedger.pin_slices`); unlike ``pinned`` it is still free
    for the next reservation's expected GPUs."""

    @property
    def kept(self) -> bool:
        """No plan may destroy, move or give it: pinned or guarded."""
        return self.pinned or self.guarded


@dataclass(slots=True)
class GpuSlots:
    index: int
    devices: list[Device] = field(default_factory=list)
    frozen: bool = False
    locked: bool = False
    """Its index, starts or users are not known exactly (adopted before the agent reported):
    its layout must stay; its free devices still take pods (:mod:`partitioner.adoption`)."""

    @property
    def used_compute(self) -> int:
        return sum(d.compute for d in self.devices if d.used or d.pinned)

    @property
    def used_devices(self) -> int:
        return sum(1 for d in self.devices if d.used or d.pinned)


@dataclass(frozen=True, slots=True)
class Hold:
    """A reservation that holds slices on its node (state planned or released, not bound)."""

    pod: PodInfo
    reservation: Reservation

    @property
    def released(self) -> bool:
        return self.reservation.state is State.RELEASED

    def order(self) -> tuple[object, ...]:
        return (not self.released, -self.pod.priority, self.reservation.since, self.pod.key)


@dataclass(slots=True)
class NodeLedger:
    info: NodeInfo
    gpu: GpuNode
    np: NodePartitioning | None
    busy: bool
    """The node has a spec it has not applied yet (nor given up on)."""
    degraded: bool
    gpus: list[GpuSlots]
    bound: Counter[str]
    held: Counter[str] = field(default_factory=Counter)
    released_unbound: Counter[str] = field(default_factory=Counter)
    holds: list[Hold] = field(default_factory=list)
    nominated: Counter[str] = field(default_factory=Counter)
    """Units of pods kube-scheduler nominated this node for (``status.nominatedNodeName``: it
    preempted pods here for them and binds them once the victims are gone): kept from every
    new reservation and plan, as kube-scheduler keeps them from lower-priority pods."""
    cpu_free: int = 0
    memory_free: int = 0
    stale_used: frozenset[str] = frozenset()
    """Resources whose bound units exceed the status-used count (agent not caught up)."""
    reported: bool = True
    """The GPUs come from the agent's report (else adopted from labels, annotations, pods)."""
    reading: _Reading | None = None
    allocated: frozenset[str] = frozenset()
    """DRA nodes: the devices claims are allocated here (:meth:`ClusterIndex.allocated_devices`),
    pinned by :meth:`pin` whatever the agent's ``used`` flags say."""
    base_pins: bool = False
    """The devices' pins are exactly :meth:`pin`'s without holds (used, or of a stale
    resource): :meth:`gpu_states` may answer from the reading's cache."""

    @property
    def name(self) -> str:
        return self.info.name

    def total(self) -> Counter[str]:
        """Devices per resource on GPUs that are not frozen (read-only)."""
        if self.reading is not None and not any(g.frozen for g in self.gpus):
            return self.reading.totals
        out: Counter[str] = Counter()
        for g in self.gpus:
            if not g.frozen:
                out.update(d.resource for d in g.devices)
        return out

    def frozen_used(self) -> Counter[str]:
        """Devices per resource on frozen GPUs that bound pods may hold: subtracted from the
        bound pods' units, whose devices on frozen GPUs are out of :meth:`total`.  Where the
        agent reports, the devices its status shows used and not foreign; an unhealthy device
        it shows free is no pod's, though the planner's view counts it used (seed 40000526 of
        the DRA promise harness: a frozen GPU's free unhealthy instance, counted as a bound
        pod's, made a bound pod's devices on another GPU look free, and both were promised)."""
        out: Counter[str] = Counter()
        if not any(g.frozen for g in self.gpus):
            return out
        reading = self.reading if self.reported else None
        for g in self.gpus:
            if not g.frozen:
                continue
            if self.gpu.dra and reading is not None:
                # The claims' allocations name the devices: exact, whatever the flags say (DRA
                # harness seed 70002048: a departed pod's device still showed used on the GPU a
                # drain froze, so a bound pod's device elsewhere counted as free and a drain
                # broke the hold of a pod released there).
                out.update(d.resource for d in g.devices if self._claimed(g, d))
            elif reading is not None:
                out.update(reading.status_used.get(g.index, Counter()))
            else:
                out.update(d.resource for d in g.devices if d.used)
        return out

    def free(self) -> Counter[str]:
        """Units of each resource a new reservation may take now (module docstring)."""
        return Counter({r: k for r, k in self._left().items() if k > 0})

    def _left(self) -> dict[str, int]:
        """:meth:`free` per resource of the devices, below 0 where the holds do not fit."""
        total, frozen_used = self.total(), self.frozen_used()
        sick = self._unhealthy()
        check_sick_used = self.reading is not None and bool(self.reading.sick_used)
        out: dict[str, int] = {}
        for r in total:
            bound = max(0, self.bound[r] - frozen_used[r])
            left = total[r] - bound - self.held[r] - self.nominated[r] - sick[r]
            if check_sick_used:
                left -= self._sick_unheld(r, bound)
                if self._admits_less():
                    left = min(left, self._scheduler_left(r, total, bound))
            out[r] = left
        return out

    def _admits_less(self) -> bool:
        """Whether kube-scheduler may admit fewer pods than there are free devices: pods sit
        on devices the agent reports unhealthy, on a node served by its device plugin.

        The kubelet's allocatable lists the healthy devices of a resource, and kube-scheduler
        subtracts every bound pod's request from it, also a pod's whose device turned
        unhealthy under it: each such pod takes a healthy device's place in the count.  A free
        healthy device there is no slice any pod can be released to (it would wait out its
        bind deadline, then be promised the same device again); :meth:`_scheduler_left` is
        what can.  DRA nodes allocate devices, not counts: never."""
        reading = self.reading
        return (
            reading is not None and bool(reading.sick_used) and self.reported and not self.gpu.dra
        )

    def _scheduler_left(self, resource: str, total: Counter[str], bound: int) -> int:
        """Units of ``resource`` kube-scheduler admits beyond the bound pods and every hold:
        the healthy devices (what allocatable lists once the kubelet has synced) less bound,
        held and nominated units.  Read from the agent's status rather than the node's
        allocatable, which lags a new layout by a kubelet sync: the two agree once it has."""
        assert self.reading is not None
        frozen = {g.index for g in self.gpus if g.frozen}
        sick = sum(c[resource] for i, c in self.reading.sick.items() if i not in frozen)
        return total[resource] - sick - bound - self.held[resource] - self.nominated[resource]

    def _sick_unheld(self, resource: str, bound: int) -> int:
        """Unhealthy devices of ``resource`` the status shows used that no bound pod may hold.

        :func:`unhealthy_free` leaves a used unhealthy device out, as a bound pod holds it
        (counted in ``bound``).  While the agent's ``used`` flags lag a departed pod, no pod
        does: counted as neither bound nor unhealthy, such a device was offered as free, and
        promised (a pod that can never bind, or the slice of the healthy device a bound pod
        holds).  Bound pods fill the healthy used devices first (a new pod never gets an
        unhealthy one), so at least ``bound - healthy used`` of them sit on unhealthy ones;
        the rest of those are kept from reservations.  Exact while the flags are current; while
        they are stale (:attr:`stale_used`: a pod may have left and another come, the new one
        on a healthy device) every such device is kept.  On a DRA node the claims'
        allocations name the devices pods hold: those no claim is allocated are counted, exact
        whatever the flags say (:attr:`stale_used` tells only that pods changed after the
        agent's last status *as the partitioner read it*, and a status written after a bind
        can still predate the claim's prepare)."""
        assert self.reading is not None
        frozen = {g.index for g in self.gpus if g.frozen}
        sick_used = used = 0
        for i, counts in self.reading.sick_used.items():
            if i not in frozen:
                sick_used += counts[resource]
        if not sick_used:
            return 0
        if self.gpu.dra and self.reported:
            # The claims' allocations name the devices: exact, whatever the flags say (DRA
            # harness seed 100001597: a departed pod's unhealthy device still showed used, a
            # new pod's healthy one not yet, equal counts, and the agent's status changed
            # after both, so nothing looked stale: the new pod counted as the one on the
            # unhealthy device, its own device looked free and was promised).
            return sum(
                1
                for i, r, profile, start in self.reading.sick_used_at
                if r == resource
                and i not in frozen
                and placement_device_name(i, profile, start) not in self.allocated
            )
        if resource in self.stale_used:
            return sick_used
        for i, counts in self.reading.status_used.items():
            if i not in frozen:
                used += counts[resource]
        on_sick = max(0, min(sick_used, bound - (used - sick_used)))
        return sick_used - on_sick

    def _unhealthy(self) -> Counter[str]:
        """Unused devices the agent reports unhealthy, on GPUs that are not frozen."""
        out: Counter[str] = Counter()
        if self.reading is not None and self.reading.unhealthy:
            frozen = {g.index for g in self.gpus if g.frozen}
            for i, bad in self.reading.unhealthy.items():
                if i not in frozen:
                    out.update(bad)
        return out

    def shortfall(self, units: Mapping[str, int]) -> str:
        """Why ``units`` no longer fit here beside the other holds, in words for an Event: the
        devices of their resources the agent reports unhealthy or used by processes outside
        any pod, the pods kube-scheduler counts on unhealthy ones, GPUs being drained; else
        another pod took the slice (one gpuslice did not gate: it gives gated pods none)."""
        causes: list[str] = []
        frozen = {g.index for g in self.gpus if g.frozen}
        reading = self.reading
        if reading is not None:

            def on(per_gpu: Mapping[int, Counter[str]]) -> int:
                return sum(c[r] for i, c in per_gpu.items() if i not in frozen for r in units)

            sick = on(reading.sick)
            if sick:
                causes.append(f"{sick} of its devices there turned unhealthy")
            foreign = on(reading.unusable) - sick
            if foreign > 0:
                causes.append(f"processes outside any pod use {foreign} of them")
            if self._admits_less() and on(reading.sick_used):
                causes.append("kube-scheduler counts the pods on unhealthy ones against it")
        if any(d.resource in units for g in self.gpus if g.frozen for d in g.devices):
            causes.append("a GPU with such slices is being drained")
        return "; ".join(causes) if causes else "another pod took it"

    def breaks_holds(self, gpus: Iterable[int]) -> bool:
        """Whether freezing ``gpus`` too (a drain) would leave some hold without its devices:
        the devices left would not cover the holds (or, on a device-plugin node whose used
        flags are stale, might not), or, on a node applying a spec, a hold made
        for it expects its new devices on one of ``gpus`` (they are not in the count yet; a
        frozen GPU's free devices go to no pod, and a DRA agent withholds them: DRA harness
        seed 70001335, a drain froze the GPU a plan was making a pod's instance on)."""
        chosen = set(gpus)
        if not self.gpu.dra and any(self.held[r] > 0 for r in self.stale_used):
            # The used flags predate a pod change: which frozen device a bound pod holds is
            # not known (on a DRA node the allocations say), so the count after the drain is
            # not either.  The drain waits for the agent's next report.
            return True
        if self.busy and any(
            h.reservation.plan
            and not chosen.isdisjoint(i for idx in h.reservation.gpus.values() for i in idx)
            for h in self.holds
        ):
            return True
        before = self._left()
        was = [(g, g.frozen) for g in self.gpus if g.index in chosen]
        for g, _ in was:
            g.frozen = True
        try:
            after = self._left()
            return any(
                k > 0 and before.get(r, -1) >= 0 and after.get(r, -1) < 0
                for r, k in self.held.items()
            )
        finally:
            for g, frozen in was:
                g.frozen = frozen

    def fits(
        self, units: Mapping[str, int], cpu: int, memory: int, kept: Mapping[str, int] | None = None
    ) -> bool:
        """Whether ``units`` (and ``cpu``, ``memory``) fit beside the holds, less ``kept``."""
        free = self.free()
        kept = kept or {}
        return (
            all(free[r] - kept.get(r, 0) >= k for r, k in units.items())
            and cpu <= self.cpu_free
            and memory <= self.memory_free
        )

    def add_hold(self, hold: Hold) -> None:
        self.holds.append(hold)
        self.held.update(hold.reservation.units())
        if hold.released:
            self.released_unbound.update(hold.reservation.units())
        self.cpu_free -= hold.pod.cpu_milli
        self.memory_free -= hold.pod.memory_mib

    def add_nominated(self, pod: PodInfo) -> None:
        """Keep what ``pod``, nominated for this node by kube-scheduler, will bind to."""
        self.nominated.update(pod.slices)
        self.cpu_free -= pod.cpu_milli
        self.memory_free -= pod.memory_mib

    def settle(self) -> list[Hold]:
        """Keep holds (released first, priority, age) while they fit; return the broken ones.

        A released hold needs its slices only (its pod is pinned here; kube-scheduler checks
        the rest at bind); a gated one its CPU and memory too: a pod that took them since the
        plan (a CPU-only pod bound here) would leave it pinned where it cannot bind, while
        still gated it can be planned elsewhere."""
        holds = sorted(self.holds, key=Hold.order)
        for h in holds:
            self.cpu_free += h.pod.cpu_milli
            self.memory_free += h.pod.memory_mib
        self.holds, self.held, self.released_unbound = [], Counter(), Counter()
        broken: list[Hold] = []
        for h in holds:
            gated = not h.released and h.pod.gated
            cpu, memory = (h.pod.cpu_milli, h.pod.memory_mib) if gated else (0, 0)
            if self.fits(h.reservation.units(), cpu, memory):
                self.add_hold(h)
            else:
                broken.append(h)
        return broken

    def has_room(self) -> bool:
        """Whether a plan could place anything here: some GPU that is not frozen has a device
        no pod holds or promised, or (unless locked) memory no pinned instance or slice covers."""
        model = self.gpu.model
        for g in self.gpus:
            if g.frozen:
                continue
            if any(not d.kept for d in g.devices):
                return True
            if g.locked:
                continue
            if self.gpu.mode is Mode.MPS:
                usable = self.gpu.gpu_memory_mib or model.memory_mib
                if sum(d.memory_mib for d in g.devices) < usable:
                    return True
                continue
            taken = 0
            for d in g.devices:
                try:
                    taken += model.profile(d.mig_profile).memory_slices
                except CatalogError:
                    return True  # unknown profile: let the planner judge
            if taken < model.memory_slots:
                return True
        return False

    def plugin_gone(self) -> str:
        """A slice resource pods bound here hold that the kubelet lists none of (its
        allocatable has no such unit), else ``""``.

        A bound pod was admitted with the device, so the kubelet can list none only when the
        device plugin that serves it is gone (the agent stopped: the kubelet marks its devices
        unhealthy at once, allocatable 0 from its next status sync), has not registered again
        yet (a kubelet restart shows no device until its plugin re-registers, seconds) or
        reports every such device unhealthy.  Either way the free slices the agent's status
        lists cannot be allocated now.  Only where the agent has reported the layout (before,
        the node is adopted from what another plugin served, which may be gone by design); DRA
        nodes publish devices, not extended resources: never."""
        if self.gpu.dra or not self.reported:
            return ""
        for resource, k in sorted(self.bound.items()):
            if k > 0 and self.info.allocatable.get(resource, 0) == 0:
                return resource
        return ""

    def unlisted(self) -> str:
        """A slice resource the agent's applied status shows healthy devices of, when the
        kubelet lists none of any such resource, else ``""``.

        The agent advertises every healthy device of its status through its device plugin, and
        the kubelet lists them at its next status sync (seconds); listing none of them at all
        means the plugin is gone or has not registered yet, as :meth:`plugin_gone` says, on a
        node where nothing bound shows it.  Only the caller can tell the seconds of a new
        layout from an agent that stopped (how long this has lasted).  Not while the node
        applies a spec (its devices change), nor where :meth:`plugin_gone` would not look."""
        if self.gpu.dra or not self.reported or self.busy:
            return ""
        # a hybrid host is no resource of its own (""): its slices are advertised
        healthy = [r for r, k in (self.total() - self._unhealthy()).items() if r and k > 0]
        if not healthy:
            return ""
        allocatable = self.info.allocatable
        if any(allocatable.get(r, 0) for r in healthy):
            return ""
        return min(healthy)

    def scheduler_room(self, resource: str) -> int:
        """Units of ``resource`` kube-scheduler would still admit beyond bound and released pods.

        On a DRA node the devices are what its agent publishes, which its status lists (the
        spec's placements and the allocated ones), not extended resources, less the free ones
        it withdraws (unhealthy, or used by processes outside any claim)."""
        if self.gpu.dra:
            allocatable = self.total()[resource] - self._unhealthy()[resource]
        else:
            allocatable = self.info.allocatable.get(resource, 0)
        return (
            allocatable
            - self.bound[resource]
            - self.released_unbound[resource]
            - self.nominated[resource]
        )

    # ------------------------------------------------------------------ GPUs

    def pin(self) -> None:
        """Pin the instances holds and unreported bound pods may be using (module docstring)."""
        stale = self.stale_used
        by_claim = False
        for g in self.gpus:
            for d in g.devices:
                d.pinned = d.used or d.resource in stale
                d.guarded = False
                if not d.pinned and self._claimed(g, d):
                    # a claim holds it: on a DRA node the allocation names the device, so no
                    # plan replaces it while the agent's flags lag (DRA harness seed 40001212)
                    d.pinned = by_claim = True
        for h in sorted(self.holds, key=Hold.order):
            released = h.reservation.state is State.RELEASED
            for r, indices in h.reservation.gpus.items():
                if released:
                    self.pin_slices(r)
                for i in indices:
                    self._pin_one(r, i)
        for r, k in sorted(self.nominated.items()):  # no GPU expected: the kubelet picks
            for _ in range(k):  # frozen GPUs too: a drain must not plan over the freed slice
                self._pin_one(r, -1, frozen_too=True)
        unadmitted = self._pin_unadmitted() if self._admits_less() else False
        self.base_pins = not self.holds and not self.nominated and not unadmitted and not by_claim

    def _claimed(self, g: GpuSlots, d: Device) -> bool:
        """Some claim is allocated ``d`` (a DRA node's placement on ``g``)."""
        return bool(
            self.allocated
            and d.mig_profile
            and placement_device_name(g.index, d.mig_profile, d.key) in self.allocated
        )

    def _pin_unadmitted(self) -> bool:
        """Pin the free devices kube-scheduler admits no pod to (:meth:`_admits_less`), the
        highest GPUs' first, so no plan counts on them; whether any was.  Kept, not replaced:
        each serves again once the pod on the unhealthy device leaves."""
        total, frozen_used = self.total(), self.frozen_used()
        pinned = False
        for r in sorted(total):
            if not r:  # a hybrid host: its slices are the resources
                continue
            bound = max(0, self.bound[r] - frozen_used[r])
            room = max(0, self._scheduler_left(r, total, bound))
            free = [
                d
                for g in sorted(self.gpus, key=lambda g: g.index)
                if not g.frozen
                for d in g.devices
                if d.resource == r and not d.pinned
            ]
            for d in free[room:]:
                d.pinned = pinned = True
        return pinned

    def pin_slices(self, resource: str) -> None:
        """A released pod's MPS slice (an MPS node, or a hybrid node's host): every free slice
        of ``resource`` on every GPU is pinned, since any of them may be the one the kubelet
        gives it (the agent's preferred allocation packs onto the GPU with the fewest free
        slices of that size, not the GPU the reservation expects, and MPS slices count no
        compute for :meth:`choose_gpus` to follow): pinning the expected GPU's alone let a plan
        destroy or resize the other one under the pod the kubelet was about to admit there,
        and the agent refused the spec (``SliceInUse``).  Only until the pod binds; then its
        slice is used and the rest free again.  The same on MIG nodes (and for a hybrid
        node's whole instances): the agent's preferred allocation takes the GPU that alone
        covers the request with the fewest free devices, not the busiest one the reservation
        expects, and the kubelet may take any free device of the resource; a plan in the same
        step destroyed the instance the kubelet was about to give (a review's c5).  No-op on
        DRA nodes, where the reservation names what kube-scheduler allocates."""
        if self.gpu.dra:
            return
        whole = mig_profile_of(resource) is not None
        for g in self.gpus:
            if not g.frozen:
                for d in g.devices:
                    if d.resource == resource and (whole or not d.mig_profile):
                        d.guarded = True
                        self.base_pins = False

    def _pin_one(self, resource: str, expected: int, frozen_too: bool = False) -> None:
        if self.gpu.dra:  # kube-scheduler's order, whatever GPU the reservation expects
            order = sorted(self.gpus, key=lambda g: (g.frozen, _allocation_order(g)))
        else:
            order = sorted(self.gpus, key=lambda g: (g.frozen, g.index != expected, g.index))
        for g in order:
            if g.frozen and not frozen_too:
                continue
            devices = sorted(g.devices, key=lambda d: d.key) if self.gpu.dra else g.devices
            for d in devices:
                if d.resource == resource and not d.pinned:
                    d.pinned = True
                    return

    def choose_gpus(self, units: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
        """Expected GPUs for a new reservation of ``units``: free instances on the busiest GPUs.

        Packing rule (the same one the node agent's preferred allocation follows): the GPU with
        the most compute in use first, so lightly used GPUs stay empty for whole-GPU pods.  On
        a DRA node the first free instances in kube-scheduler's allocation order instead
        (module docstring): those it will allocate.
        """
        out: dict[str, tuple[int, ...]] = {}
        self.base_pins = False
        for r in sorted(units):
            options = [
                (g, d)
                for g in self.gpus
                if not g.frozen
                for d in g.devices
                if d.resource == r and not d.pinned
            ]
            if self.gpu.dra:  # the device kube-scheduler allocates first
                options.sort(key=lambda gd: (_allocation_order(gd[0]), gd[1].key))
            else:
                options.sort(key=lambda gd: (-gd[0].used_compute, gd[0].index, gd[1].key))
            picked: list[int] = []
            for g, d in options:
                if len(picked) == units[r]:
                    break
                picked.append(g.index)
                d.pinned = True
            while len(picked) < units[r]:  # status not caught up: expect the busiest GPU
                fallback = [
                    g for g in self.gpus if not g.frozen and any(d.resource == r for d in g.devices)
                ]
                # one with a device of ``r`` that may serve (a used one whose pod left) and is
                # not named yet: not a GPU whose devices of ``r`` are all unhealthy or foreign
                # (the busiest, as those count as used), which the kubelet never gives
                fallback.sort(
                    key=lambda g: (
                        self._usable(g, r) <= picked.count(g.index),
                        -g.used_compute,
                        g.index,
                    )
                )
                picked.append(fallback[0].index if fallback else 0)
            out[r] = tuple(picked)
        return out

    def _usable(self, g: GpuSlots, resource: str) -> int:
        """``g``'s devices of ``resource`` that are neither unhealthy nor foreign."""
        have = sum(1 for d in g.devices if d.resource == resource)
        bad = self.reading.unusable.get(g.index) if self.reading is not None else None
        return have - (bad[resource] if bad is not None else 0)

    def gpu_states(self) -> tuple[GpuState, ...]:
        """The planner's view of the node's GPUs: pinned devices as used, frozen GPUs left out."""
        cache = None
        if self.base_pins and self.reading is not None and not any(g.frozen for g in self.gpus):
            cache = self.reading.states
            hit = cache.get(self.stale_used)
            if hit is not None:
                return hit
        out: list[GpuState] = []
        mps = self.gpu.mode is Mode.MPS
        foreign = self.reading.foreign if self.reading is not None else frozenset()
        for g in self.gpus:
            if g.frozen or g.index in foreign:
                # frozen: drained; foreign: a pod holds a device of the other mode there (left
                # from before the node was relabelled, :func:`gpus_from_status`): no plan
                # touches the GPU, and its spec entry is left out, so the agent leaves it be
                continue
            if mps and g.locked:
                # Unhealthy as a whole (:func:`gpus_from_status`: an MPS GPU is locked for
                # nothing else).  The planners keep only a MIG GPU's layout when locked
                # (``GpuState.locked``) and would add slices to its free memory, which the
                # agent advertises Unhealthy: a promise no pod can bind to.  Left out as a
                # frozen GPU is, its spec entry stays what the agent reports.
                continue
            out.append(_planner_gpu(g, mps))
        states = tuple(out)
        if cache is not None:
            if len(cache) >= 8:  # stale sets come and go; keep a few
                cache.clear()
            cache[self.stale_used] = states
        return states

    @property
    def foreign(self) -> frozenset[int]:
        """GPUs a pod holds a device of the other mode on (:func:`_held_foreign`): left out of
        plans, and of the spec (:func:`partitioner.decide._desired_now`)."""
        if self.reading is not None:
            return self.reading.foreign
        return _held_foreign(
            gpus_from_status(self.np, self.gpu.gpu_count, self.gpu.mode), self.gpu.mode
        )

    def node_state(self) -> NodeState:
        return NodeState(
            name=self.name,
            mode=self.gpu.mode,
            model=self.gpu.model.name,
            gpus=self.gpu_states(),
            cpu_milli_free=max(0, self.cpu_free),
            memory_mib_free=max(0, self.memory_free),
            gpu_memory_mib=self.gpu.gpu_memory_mib,
        )


def _gpu_state(g: GpuSlots, mps: bool) -> GpuState:
    """The planner's view of one GPU (:meth:`NodeLedger.gpu_states`)."""
    if mps:
        slices = tuple(MpsSlice(d.memory_mib, d.kept, d.thread_percentage) for d in g.devices)
        return GpuState(g.index, mps=slices, locked=g.locked)
    hosted: dict[int, list[MpsSlice]] = {}  # hybrid: slices by their host's start
    for d in g.devices:
        if not d.mig_profile:
            hosted.setdefault(d.key, []).append(MpsSlice(d.memory_mib, d.kept, d.thread_percentage))
    return GpuState(
        g.index,
        mig=tuple(
            MigInstance(
                d.mig_profile,
                d.key,
                # a host is used through its slices, unless sealed (used)
                d.kept if d.resource else d.used,
                tuple(hosted.get(d.key, ())),
            )
            for d in g.devices
            if d.mig_profile
        ),
        locked=g.locked,
    )


def _planner_gpu(g: GpuSlots, mps: bool) -> GpuState:
    """:func:`_gpu_state`, memoised on every field it reads (:data:`_GPU_STATES`)."""
    key = (
        mps,
        g.index,
        g.locked,
        tuple(
            (d.mig_profile, d.key, d.resource, d.used, d.kept, d.memory_mib, d.thread_percentage)
            for d in g.devices
        ),
    )
    state = _GPU_STATES.get(key)
    if state is None:
        if len(_GPU_STATES) >= _GPU_STATES_MAX:
            _GPU_STATES.clear()
        state = _GPU_STATES[key] = _gpu_state(g, mps)
    return state


_GPU_STATES: dict[tuple[object, ...], GpuState] = {}
""":func:`_gpu_state` per (mode is MPS, index, locked, every device's fields it reads): GPUs in
a cluster take a few hundred distinct states, so building a node's planner view after its
status changed costs a lookup per GPU instead of a dozen frozen objects.  The states are
immutable; nodes share them."""
_GPU_STATES_MAX = 16384


_Row = tuple[str, int, int, bool, str, int, int | None]
"""(resource, key, compute, used, MIG profile, memory MiB, thread %) of one device."""


@dataclass(frozen=True, slots=True)
class _Reading:
    """A node's GPUs now (:mod:`partitioner.adoption`), as device rows per GPU."""

    adopted: Adopted
    rows: tuple[tuple[_Row, ...], ...]
    locked: frozenset[int]
    foreign: frozenset[int] = frozenset()
    """GPUs a pod holds a device of the other mode on (:func:`_held_foreign`)."""
    states: dict[frozenset[str], tuple[GpuState, ...]] = field(
        default_factory=dict, compare=False, hash=False
    )
    """:meth:`NodeLedger.gpu_states` of a ledger read from this reading whose only pins are
    the base ones (status-used devices, and every device of a resource in ``stale_used``, the
    key) and that has no frozen GPU: the same every cycle until the reading changes."""
    bounds: dict[object, tuple[Counter[str], Counter[str], tuple[int, ...]]] = field(
        default_factory=dict, compare=False, hash=False
    )
    """Per-reading memo of :class:`partitioner.decide._UnitBounds` (same conditions)."""
    unhealthy: dict[int, Counter[str]] = field(default_factory=dict, compare=False, hash=False)
    """GPU index -> devices per resource the agent reports unhealthy and no pod uses
    (:func:`unhealthy_free`): kept from every reservation."""
    sick_used: dict[int, Counter[str]] = field(default_factory=dict, compare=False, hash=False)
    """GPU index -> devices per resource reported unhealthy and used (not foreign): a bound
    pod's, unless it left since (:meth:`NodeLedger._sick_unheld`)."""
    status_used: dict[int, Counter[str]] = field(default_factory=dict, compare=False, hash=False)
    """GPU index -> devices per resource the agent reports used (not foreign)."""
    unusable: dict[int, Counter[str]] = field(default_factory=dict, compare=False, hash=False)
    """GPU index -> devices per resource reported unhealthy or foreign, used or not."""
    sick: dict[int, Counter[str]] = field(default_factory=dict, compare=False, hash=False)
    """GPU index -> devices per resource reported unhealthy, used or not: the devices the
    kubelet leaves out of allocatable (:meth:`NodeLedger._scheduler_left`)."""
    sick_used_at: frozenset[tuple[int, str, str, int]] = field(
        default=frozenset(), compare=False, hash=False
    )
    """(GPU index, resource, profile, start) of each MIG instance counted in
    :attr:`sick_used` (none hosts MPS slices): on a DRA node the claims' allocations tell
    which of them a pod holds (:meth:`NodeLedger._sick_unheld`)."""
    totals: Counter[str] = field(default_factory=Counter, compare=False, hash=False)
    """Devices per resource over all GPUs (read-only)."""
    used: Counter[str] = field(default_factory=Counter, compare=False, hash=False)
    """Status-used devices per resource over all GPUs (read-only)."""
    status_used_total: Counter[str] = field(default_factory=Counter, compare=False, hash=False)
    """:attr:`status_used` summed over all GPUs (read-only)."""

    def __post_init__(self) -> None:
        for rows in self.rows:
            for r, _k, _c, u, _p, _m, _t in rows:
                self.totals[r] += 1
                if u:
                    self.used[r] += 1
        for used in self.status_used.values():
            self.status_used_total.update(used)


def _allocation_order(g: GpuSlots) -> str:
    """Where kube-scheduler's DRA allocator looks at ``g``'s devices: it walks the node's
    ResourceSlices by name, one per GPU (``...-devices-gpu<index>``, so by the index *as text*:
    ``gpu10`` before ``gpu2``), and a slice's devices in order (of one profile: by start), taking
    the first free device whose counters fit (shared/facts/dra.md, section 2)."""
    return str(g.index)


def _rows(model: GpuModel, gpus: Sequence[GpuState]) -> tuple[tuple[_Row, ...], ...]:
    out: list[tuple[_Row, ...]] = []
    for g in gpus:
        rows: list[_Row] = []
        for m in g.mig:
            try:
                compute = model.profile(m.profile).compute
            except CatalogError:
                compute = 0
            # a hybrid host is no resource of its own: its slices are (key: the host's start)
            resource = "" if m.mps else instance_resource(model, m.profile)
            rows.append((resource, m.start, compute, m.used, m.profile, 0, None))
            for sl in m.mps:
                gb = sl.memory_mib // MIB_PER_GIB
                rows.append(
                    (mps_resource(gb), m.start, 0, sl.used, "", sl.memory_mib, sl.thread_percentage)
                )
        for k, sl in enumerate(g.mps):
            rows.append(
                (
                    mps_resource(sl.memory_mib // MIB_PER_GIB),
                    k,
                    0,
                    sl.used,
                    "",
                    sl.memory_mib,
                    sl.thread_percentage,
                )
            )
        out.append(tuple(rows))
    return tuple(out)


def _status_devices(
    np: NodePartitioning | None, model: GpuModel
) -> Iterator[tuple[int, str, bool, bool, bool, tuple[str, int] | None]]:
    """Every device the agent's status lists, as ``(GPU index, resource, used, unhealthy,
    foreign, placement)``: each MIG instance that hosts no MPS slices (placement: its profile
    and start), each slice a hybrid instance hosts, each MPS slice of a GPU (placement
    ``None``); unhealthy when it, its instance or its GPU is reported so; foreign when it or its
    host instance is (a pod given a slice of a foreign host would share the instance with
    processes of no pod, as one given a foreign instance would)."""
    for g in np.status.gpus if np is not None and np.status is not None else ():
        for m in g.mig:
            sick = g.unhealthy or m.unhealthy
            if not m.mps:
                r = instance_resource(model, m.profile)
                yield g.index, r, m.used, sick, m.foreign, (m.profile, m.start)
            for sl in m.mps:
                r = mps_resource(sl.memoryMiB // MIB_PER_GIB)
                yield g.index, r, sl.used, sick or sl.unhealthy, m.foreign, None
        for sl in g.mps:
            r = mps_resource(sl.memoryMiB // MIB_PER_GIB)
            yield g.index, r, sl.used, g.unhealthy or sl.unhealthy, False, None


def unhealthy_free(np: NodePartitioning | None, model: GpuModel) -> dict[int, Counter[str]]:
    """Per GPU index, the devices per resource no pod may be promised though no pod holds
    them: those the agent reports ``unhealthy`` (the GPU as a whole, or the instance or
    slice) and not used -- the kubelet advertises them Unhealthy, so a pod promised one would
    never bind -- and the MIG instances it reports ``foreign`` (used by processes no pod or
    claim holds them for: a pod given one would share it, or in DRA mode fail its prepare)."""
    out: dict[int, Counter[str]] = {}
    for i, r, used, sick, foreign, _at in _status_devices(np, model):
        if (sick and not used) or foreign:
            out.setdefault(i, Counter())[r] += 1
    return out


_PerGpu = dict[int, Counter[str]]


def _used_health(
    np: NodePartitioning | None, model: GpuModel
) -> tuple[_PerGpu, _PerGpu, _PerGpu, _PerGpu, frozenset[tuple[int, str, str, int]]]:
    """Per GPU index and resource: the devices reported unhealthy and used (not foreign), those
    reported used (not foreign), those reported unhealthy or foreign, and those reported
    unhealthy; and where the first are MIG instances, their placements (:class:`_Reading`)."""
    sick_used: _PerGpu = {}
    used: _PerGpu = {}
    unusable: _PerGpu = {}
    sick_all: _PerGpu = {}
    sick_used_at: set[tuple[int, str, str, int]] = set()
    for i, r, u, sick, foreign, at in _status_devices(np, model):
        if sick or foreign:
            unusable.setdefault(i, Counter())[r] += 1
        if sick:
            sick_all.setdefault(i, Counter())[r] += 1
        if u and not foreign:
            used.setdefault(i, Counter())[r] += 1
            if sick:
                sick_used.setdefault(i, Counter())[r] += 1
                if at is not None:
                    sick_used_at.add((i, r, *at))
    return sick_used, used, unusable, sick_all, frozenset(sick_used_at)


def _pseudo_pod(pod: PodInfo) -> dict[str, object]:
    """What :func:`partitioner.adoption.adopt` reads of a bound pod: its name and GPU requests
    (slices, whole GPUs, and the replicas of time-sliced GPUs that NVIDIA's plugin names
    ``nvidia.com/gpu.shared`` under ``renameByDefault``, kept in
    :attr:`~partitioner.index.PodInfo.other_requests`: held, they make the node
    ``TimeSlicedBeforeAgent`` as they do in the what-if reader)."""
    limits: dict[str, object] = {r: str(k) for r, k in pod.slices.items()}
    if pod.whole_gpus:
        limits["nvidia.com/gpu"] = str(pod.whole_gpus)
    for r, v in pod.other_requests:
        if _is_shared(r):  # the parsed quantity as it is: adopt reads it as the raw pod's
            limits[r] = v
    return {
        "metadata": {"name": pod.name, "namespace": pod.namespace},
        "spec": {"containers": [{"name": "c", "resources": {"limits": limits}}]},
    }


def read_gpus(index: ClusterIndex, info: NodeInfo) -> _Reading | NodeProblem:
    """The node's GPUs now: the agent's report, else adopted; cached per input version."""
    gpu = info.gpu
    assert gpu is not None
    np_info = index.partitionings.get(info.name)
    np = np_info.np if np_info is not None else None
    reported = agent_reported(np)
    key = (  # the node's own content is fixed per NodeInfo (the index replaces it on change)
        np_info.rv if np_info is not None else None,
        None if reported else index.node_pods.get(info.name),
    )
    cached = info.derived
    if cached is not None and cached[0] == key:
        result: _Reading | NodeProblem = cached[1]
        return result
    labels = gpu.labels
    if labels is None:
        adopted: Adopted | LabelProblem = Adopted(
            gpu.gpu_count, gpus_from_status(np, gpu.gpu_count, gpu.mode), "agent"
        )
    else:
        pods = [] if reported else [_pseudo_pod(p) for p in index.bound_pods(info.name)]
        adopted = adopt(info.obj, gpu.mode, labels, np, pods, index.catalog)
    other = other_model(np, gpu.model, index.catalog) if reported and labels is None else None
    if isinstance(adopted, LabelProblem):
        result = NodeProblem(info.name, adopted.reason, adopted.message)
    elif other is not None:
        result = NodeProblem(info.name, "MixedGpuModels", other)
    else:
        agent = adopted.source == "agent"
        sick_used, status_used, unusable, sick, sick_used_at = _used_health(
            np if agent else None, gpu.model
        )
        result = _Reading(
            adopted,
            _rows(gpu.model, adopted.gpus),
            frozenset(g.index for g in adopted.gpus if g.locked),
            foreign=_held_foreign(adopted.gpus, gpu.mode),
            unhealthy=unhealthy_free(np, gpu.model) if agent else {},
            sick_used=sick_used,
            status_used=status_used,
            unusable=unusable,
            sick=sick,
            sick_used_at=sick_used_at,
        )
    info.derived = (key, result)
    return result


def _held_foreign(gpus: Sequence[GpuState], mode: Mode) -> frozenset[int]:
    """GPUs where a pod holds a device of the other mode than the node's ``mode`` (left from
    before it was relabelled): :func:`~partitioner.adoption.gpus_from_status` locks them and
    keeps their devices."""
    return frozenset(g.index for g in gpus if g.locked and foreign_mode(g, mode))


def _gpus(reading: _Reading, frozen: frozenset[int]) -> list[GpuSlots]:
    return [
        GpuSlots(
            g.index,
            [
                Device(r, k, c, u, False, p, m, th)  # positional: half the cost, per cycle
                for r, k, c, u, p, m, th in devices
            ],
            frozen=g.index in frozen,
            locked=g.index in reading.locked,
        )
        for g, devices in zip(reading.adopted.gpus, reading.rows, strict=True)
    ]


def _status_used(gpus: Sequence[GpuSlots]) -> Counter[str]:
    out: Counter[str] = Counter()
    for g in gpus:
        if not g.frozen:
            out.update(d.resource for d in g.devices if d.used)
    return out


def build_ledgers(
    index: ClusterIndex,
    busy: Iterable[str],
    degraded: Iterable[str],
    frozen: Mapping[str, frozenset[int]],
) -> tuple[dict[str, NodeLedger], dict[str, NodeProblem]]:
    """A ledger per GPU node whose GPUs can be read (without holds: add them with
    :meth:`NodeLedger.add_hold`), and the nodes whose GPUs cannot be read yet, with why."""
    busy_set, degraded_set = set(busy), set(degraded)
    out: dict[str, NodeLedger] = {}
    problems: dict[str, NodeProblem] = {}
    for name, info in index.gpu_nodes().items():
        gpu = info.gpu
        assert gpu is not None
        nos = index.nos_agents.get(name)
        if nos:
            problems[name] = NodeProblem(
                name,
                "NosActive",
                f"nos still runs on this node (pod {min(nos)}, label "
                f"{'='.join(NOS_AGENT_LABEL)}): its agent and gpuslice's would both change the "
                "GPUs; uninstall nos first (docs/operations.md, 'Migrate from nos')",
            )
            continue
        reading = read_gpus(index, info)
        if isinstance(reading, NodeProblem):
            problems[name] = reading
            continue
        if reading.adopted.gpu_count != gpu.gpu_count:
            gpu = replace(gpu, gpu_count=reading.adopted.gpu_count)
        np_info = index.partitionings.get(name)
        np = np_info.np if np_info is not None else None
        gpus = _gpus(reading, frozen.get(name, frozenset()))
        usage = index.usage(name)
        ledger = NodeLedger(
            info=info,
            gpu=gpu,
            np=np,
            allocated=index.allocated_devices(name) if gpu.dra else frozenset(),
            busy=name in busy_set,
            degraded=name in degraded_set,
            gpus=gpus,
            bound=Counter(usage.slices),
            cpu_free=gpu.cpu_milli - usage.cpu_milli,
            memory_free=gpu.memory_mib - usage.memory_mib,
            reported=reading.adopted.source == "agent",
            reading=reading,
        )
        status_used: Counter[str]
        if ledger.reported:
            # Devices the agent reports used that a pod may hold: not a foreign one (used by
            # processes of no pod), nor an unhealthy one it reports free (counted used for the
            # planner, :func:`gpus_from_status`).  Counting those hid a bound pod the agent
            # has not reported yet, whose device then showed free to the planner: a plan gave
            # it to another pod ("slice free on the node") or replaced it.
            on_frozen = frozen.get(name)
            if not on_frozen:
                status_used = reading.status_used_total
            else:
                status_used = Counter()
                for i, used in reading.status_used.items():
                    if i not in on_frozen:
                        status_used.update(used)
        else:
            status_used = _status_used(gpus) if name in frozen else reading.used
        frozen_used = ledger.frozen_used()
        if np_info is not None and np_info.pods_seen != index.node_pods.get(name, 0):
            # Pods bound to the node changed since the agent's last report: its used flags
            # may show a departed pod's device and miss a new one with equal counts.
            ledger.stale_used = frozenset(r for r, k in usage.slices.items() if k > 0)
        else:
            ledger.stale_used = frozenset(
                r for r, k in usage.slices.items() if k - frozen_used[r] > status_used[r]
            )
        if ledger.reported and not gpu.dra and reading.sick_used:
            ledger.stale_used |= _flags_decide(reading, usage.slices, frozen.get(name))
        out[name] = ledger
    return out, problems


def _flags_decide(
    reading: _Reading, bound: Mapping[str, int], frozen: frozenset[int] | None
) -> frozenset[str]:
    """Resources whose free count on a device-plugin node would rest on the ``used`` flags
    alone: bound pods hold some, a device of it is shown unhealthy and used, and another is
    healthy and ``foreign`` (not frozen, all three).

    While the flags are current, bound pods sit on the healthy used devices first and the
    unhealthy used ones hold the rest (:meth:`NodeLedger._sick_unheld`).  A status written
    after a bind and before the kubelet's ``Allocate`` shows the new pod's device free while a
    departed pod's unhealthy one still shows used: equal counts, pods unchanged since the last
    report read, so nothing looks stale, and the flags put the new pod on the unhealthy device.
    What kube-scheduler admits caps the count right whichever it is (allocatable lists the
    healthy devices, the bound pods' requests count against it:
    :meth:`NodeLedger._admits_less`) -- unless a healthy device is foreign: advertised, so
    admitted, but no pod can use it.  There such a resource is treated as stale: every
    unhealthy used device kept from reservations, every device pinned.  The cost, while a pod
    runs on an unhealthy device beside a foreign one: the node's free devices of that resource
    wait for one of them to end."""
    skip = frozen or frozenset()
    sick_used: Counter[str] = Counter()
    foreign: Counter[str] = Counter()
    for i, counts in reading.sick_used.items():
        if i not in skip:
            sick_used.update(counts)
    for i, counts in reading.unusable.items():
        if i not in skip:
            foreign.update(counts)
            foreign.subtract(reading.sick.get(i, Counter()))
    return frozenset(r for r, k in bound.items() if k > 0 and sick_used[r] > 0 and foreign[r] > 0)
