"""The node agent in DRA mode: the kubelet plugin, the ResourceSlice publisher and one loop.

Model
-----
:class:`DraDriver` runs, in this order:

1. :meth:`~node_agent.dra_prepare.DraPreparer.clean_unknown`: claims whose prepare the last
   agent did not finish are rolled back, idle MIG instances no claim owns are destroyed (used
   ones are kept and logged; a GPU NVML cannot read is skipped, NVML itself down stops the
   start);
2. the kubelet plugin (:class:`~node_agent.draplugin.DraKubeletPlugin`): registration and
   DRA servers;
3. a publish loop: :meth:`~node_agent.dra_publish.SlicePublisher.publish` now, again whenever
   the kubelet (re)registers the plugin (a starting kubelet deletes its node's slices) and at
   least every ``resync_s`` (repairing slices someone changed or deleted); a failed round is
   retried after ``retry_s``.  Each round's outcome goes to the health check
   (:class:`~node_agent.health.AgentHealth`), so an API server that keeps refusing the slices
   (e.g. with DRAPartitionableDevices off) turns ``/healthz`` unhealthy with that reason.  With
   that gate off no device slice is ever written: the publisher checks the counter slice alone,
   backing off, and refuses the rounds between without writing (:mod:`node_agent.dra_publish`).

The kubelet's registration.  A device published on a node whose kubelet has not registered
the plugin is allocatable, but the kubelet calls no prepare for it ("DRA driver ... is not
registered"): its pod waits in ContainerCreating for good, with no prepare failure to report
and a live agent.  So the loop publishes only for a registered plugin
(:attr:`~node_agent.draplugin.DraKubeletPlugin.registered`):

* while the plugin waits for the kubelet's first registration (after it started, or served
  its registration socket anew) a round does nothing at all -- no slice written, no status:
  on a new node nothing is published until the kubelet registers it, and after an agent
  restart the slices stay as the last agent left them for the moment it takes -- and tells
  the health check it waits: ``/readyz`` says ``not ready`` with why, ``/healthz`` stays
  ``ok``;
* once the kubelet refused the plugin (``NotifyRegistrationStatus`` with an error: a kubelet
  that knows neither service version listed) or has not registered it within
  ``registration_grace_s`` (default: the health check's limit, ``failure_resyncs`` resyncs; a
  registry directory the kubelet does not watch -- a wrong ``dra.hostPaths.registryDir``, a
  kubelet with another root directory), every round withdraws every free device (the
  allocated and prepared ones stay published: their counters must keep counting), logs the
  problem once (at ERROR, when it changes), tells the health check, so ``/readyz`` fails
  naming the kubelet's error and the sockets
  (:meth:`~node_agent.draplugin.DraKubeletPlugin.registration_problem`), and in
  shaped mode reports ``Degraded`` with reason ``DriverNotRegistered``, every GPU
  ``unhealthy``, so the partitioner promises nothing here.  A refusal wakes a round at once;
  the end of the grace does too.  The next registration publishes as usual.  Neither the wait
  nor the problem fails liveness (``/healthz``, the chart's livenessProbe): a restart cannot
  fix a kubelet that watches another registry directory, and each new container would only
  wait the grace again -- a crash loop that also loses the logged explanation.

Every round starts by listing the GPUs NVML cannot read
(:meth:`~node_agent.dra_prepare.DraPreparer.unreadable`: one GPU's reads failing,
``GPU_IS_LOST`` typically).  Such a GPU is isolated for the round, the device-plugin agent's
rule: its free devices are withdrawn, its allocated ones stay published (why:
:mod:`node_agent.dra_shape`), nothing on it is created or destroyed, and the other GPUs are
served as usual; the set is logged when it changes (:attr:`DraDriver.unreadable`).  NVML itself
down (the device count unreadable, a driver-wide code) fails the round: nothing is published,
``/healthz`` learns why, and the round is retried after ``retry_s``.

A GPU unreadable when the agent started is in that list too (its model unknown, it is in no
slice); each round first tries it again (:meth:`~node_agent.dra_prepare.DraPreparer.read_pending`)
and, once it reads, adds it to the publisher's GPUs: published from that round on, without a
restart.

XID critical errors (:mod:`node_agent.xid`): with an :class:`~node_agent.xid.XidWatcher`
(``xids``; none, or one switched off by the setting ``xid_watch``, watches nothing), :meth:`run`
waits for NVML's XID events in a worker thread beside the loop, as the device-plugin agent
does (:func:`~node_agent.xid.watching`).  Every event is counted
(``gpuslice_agent_xid_errors_total``, ``metrics``); a critical one is logged at WARNING and
wakes a round at once, which resolves it (:meth:`~node_agent.dra_prepare.DraPreparer.mark_xids`:
the placement of the instance it names, else the whole GPU; an event that came in before the GI
id it names was destroyed or created marks the whole GPU) and keeps the devices it made
unhealthy from new claims until the agent restarts -- shaped publishing withdraws the free ones
(the lost-GPU path, by device instead of by GPU), mode ``all`` publishes them tainted or
withdraws their GPU's free devices (below);
prepare refuses new claims there; nothing is created or destroyed over it; the shaped status
says ``Degraded``/``GpuXid``.  An ignored one (an application error) is logged at INFO only.
A GPU unreadable when the watch started is not registered for events until the agent restarts.

Publishing every placement (``spec_source=None``, ``dra_publish=all``) is then the whole story;
there an unreadable GPU publishes only the devices prepared on it (the preparer's checkpoint:
this mode lists no claims).  A claim allocated there but not prepared yet is withdrawn with the
free devices -- harmless: no free device of that GPU is published, so nothing can be allocated
beside it, and every device of the GPU is published again once it reads.  Devices an XID hit or
processes outside any claim use are published with the ``NoSchedule`` taint
(:data:`~node_agent.dra_slices.UNUSABLE_TAINT_KEY`) where the API server keeps device taints;
where it drops them, every free device of their GPU is withdrawn, as for an unreadable GPU.
Withdrawing only those devices dropped one allocated to a claim not prepared yet, whose counters
then stopped counting: an overlapping placement went to another claim and the first could never
be prepared (:func:`_all_but_unhealthy`).

Planner-shaped publishing (a ``spec_source``: the node's NodePartitioning, and ``claims``: the
cluster's ResourceClaims; :mod:`node_agent.dra_shape`) adds, per round and in this order: read
the NodePartitioning (a 404 is "no spec"; another failure fails the round), list the allocated
devices, hand the spec's placements to the preparer (:attr:`DraPreparer.planned
<node_agent.dra_prepare.DraPreparer.planned>`: kept at unprepare), destroy the idle instances no
claim owns outside the planned and allocated placements (:attr:`DraDriver.idle_destroyed`
counts them), create the planned placements' instances that are missing
(:meth:`~node_agent.dra_prepare.DraPreparer.make_planned`, :attr:`DraDriver.planned_created`;
an NVML failure in either is logged, not fatal: prepare makes what is missing), publish the
shaped set (the unreadable GPUs' free devices withheld, like drained ones), and write the
status when it differs from the stored one (``Degraded``/``GpuUnreadable`` while a GPU is
unreadable).  A planned placement the round could not make (:attr:`DraDriver.unmade`: its
GPU's MIG mode could not be switched on -- a pass-through VM with no reset, an agent without
nvidia-smi, another client holding the GPU -- or its creation failed) is withdrawn while free
and reported: ``Degraded``/``MIGModePending`` naming the GPU and the remedy, the GPU
``unhealthy`` (or ``InstanceNotCreated``, the placement ``unhealthy``), so the partitioner
promises none of it; before, the status showed it free, and every pod released there failed
its prepare, was stranded, and its replacement was promised the same placement.  Each round
tries again, and the first that makes it publishes and reports it as usual.  The start-up
clean-up reads the NodePartitioning first, so it keeps idle instances at planned placements
(unreadable: it destroys them all, as without shaping); it
skips a GPU NVML cannot read.  Rounds also run

* when the NodePartitioning changes: every ``spec_poll_s`` it is read, and a uid,
  ``metadata.generation`` or set of drained GPUs (``status.reservations`` in state
  ``draining``, whose free devices are not published) other than the last round's wakes the
  loop (the agent's own status writes change none of them);
* after every prepare and unprepare of the kubelet plugin (a new allocation, a freed instance:
  the status's ``used`` flags and the idle clean-up follow at once; in mode ``all`` too);
* ``spec_poll_s`` after a round that stopped publishing some device, so that an allocation that
  raced with the narrowing (made against the older slices) is published again quickly;
* ``spec_poll_s`` after a round that publishes a *lingering* device (:attr:`DraDriver.lingering`):
  one published only because a claim has it allocated (the round would not publish it free: an
  XID hit it, processes outside any claim use it, its GPU is drained or unreadable, the spec
  no longer plans it) while no claim is prepared on it on this node.  Below.

Lingering devices.  An allocated device stays published whatever it is
(:mod:`node_agent.dra_shape`, "Why allocated devices stay published"), and a round learns that
its claim was deallocated only by listing the claims.  The plugin is not told of
deallocations: the kubelet unprepares a claim after the pod's containers stopped and *before*
it reports the pod's terminal status, so that the resourceclaim controller, which deallocates
once no pod in ``reservedFor`` can run any more, deallocates after it (kubelet
``SyncTerminatingPod``: "to avoid race conditions with the resource deallocation code";
shared/facts/dra.md section 3).  The round that unprepare wakes therefore still sees the claim
allocated, and the deallocation follows with no call to the plugin -- as does that of a claim
never prepared here (its pod deleted while its prepare kept failing, on just such a device; an
allocation kube-scheduler took back after a failed binding).  Until the next round the device
stayed published and, after the deallocation, free: kube-scheduler could allocate a device an
XID hit or a foreign process uses, its prepare then failed and the pod was stranded -- for up
to ``resync_s``.  So while some published device lingers the loop runs again after
``spec_poll_s``, and the first round after the deallocation withdraws the device.  The wait
doubles, up to ``resync_s``, with every round that finds the same lingering devices and no
prepare or unprepare in between (:meth:`DraDriver._on_claims_changed`); a new lingering device,
or any prepare or unprepare, starts it at ``spec_poll_s`` again.  On the ordinary path (the
claim deallocated within a moment of its unprepare) the device leaves the slices within
``spec_poll_s`` of the deallocation; a claim allocated on such a device whose pod waits for
hours costs a round per ``resync_s``, not one per ``spec_poll_s``.

A poll, not a watch of ResourceClaims: every round lists the claims already (all namespaces,
:class:`~node_agent.dra_shape.ShapeApi`); a watch would be a second stream of every claim in
the cluster on every node, held open for the rare moments a device lingers, while the poll
costs rounds only while one does.  The poll alone leaves a window: kube-scheduler sees the
deallocation at once, the agent at its next round, so for up to ``spec_poll_s`` after it (on
the ordinary path) the freed device was allocatable; and a claim deallocated *before* its
unprepare (a force-deleted pod, a kubelet that is down) leaves the device prepared here and
published until the kubelet unprepares it (its reconcile loop, every 60 s), whose round
withdraws it.  So every round publishes the devices it keeps only for their allocation while
no new claim can use them (an XID hit them, processes outside any claim use them, their GPU
cannot be read: :func:`~node_agent.dra_shape.unusable_taints`) with the ``NoSchedule`` taint
:data:`~node_agent.dra_slices.UNUSABLE_TAINT_KEY`: kube-scheduler allocates a tainted device to
no claim that does not tolerate it (a claim's request tolerating every taint would), and the
taint is there from the round that found the device unusable, before any deallocation.  What
remains is the time from the device turning unusable to that round (an XID wakes one at once;
a foreign process is found at the next round), and clusters whose API server drops device
taints (DRADeviceTaints off: :mod:`node_agent.dra_publish`), where the poll is all there is.

Mode ``all`` lists no claims: a device there is published beside the free ones because it is
prepared (the checkpoint), so the round every prepare and unprepare wakes (in both modes)
withdraws a hidden device at its unprepare, before the deallocation; nothing lingers.

:meth:`DraDriver.run` returns when ``stop`` is set; the plugin's sockets are removed on the
way out (the kubelet then deregisters the driver) and nothing on the GPUs is touched: prepared
instances keep serving their pods, and the next agent finds them in the checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Collection, Mapping, Sequence
from typing import Protocol, runtime_checkable

from contract.nodepartitioning import PARTITIONER_STATUS_FIELDS, NodePartitioning
from node_agent.agent import SpecSource, draining_gpus, now_rfc3339
from node_agent.dra_claims import DeviceTarget
from node_agent.dra_foreign import ForeignUse, foreign_devices, whole_gpus
from node_agent.dra_prepare import PlannedOutcome
from node_agent.dra_publish import SlicePublisher
from node_agent.dra_shape import planned_devices, publish_set, shaped_status, unusable_taints
from node_agent.dra_slices import UNUSABLE_TAINT_KEY, DraGpu
from node_agent.draplugin import DraKubeletPlugin
from node_agent.gpu_plan import Block
from node_agent.health import AgentHealth
from node_agent.nvml import NvmlError, XidEvent
from node_agent.tasks import first_of
from node_agent.xid import XidCounter, XidWatcher, report_events, watching

__all__ = ["DraDriver"]

log = logging.getLogger(__name__)


def _draining(obj: NodePartitioning | None) -> frozenset[int]:
    """The GPUs the partitioner drains on this node (its ``status.reservations``)."""
    if obj is None or obj.status is None:
        return frozenset()
    return draining_gpus(obj.status.model_dump(mode="json"))


def _key(
    obj: NodePartitioning | None, draining: frozenset[int] | None = None
) -> tuple[str, int, tuple[int, ...]] | None:
    """What a round depends on in the object: its uid, generation and drained GPUs
    (``draining``, when the caller has them already; ``None``: no object)."""
    if obj is None:
        return None
    drained = _draining(obj) if draining is None else draining
    return (obj.metadata.uid or "", obj.metadata.generation or 0, tuple(sorted(drained)))


def _planned(
    gpus: Sequence[DraGpu], obj: NodePartitioning | None, waiting: Collection[int] = ()
) -> tuple[dict[int, list[str]], list[str], frozenset[str]]:
    """The spec's placements per GPU, the placements skipped (why, one line each) and the
    names of all planned devices (what unprepare and the clean-up keep); the ``waiting`` GPUs'
    placements are neither (:func:`~node_agent.dra_shape.planned_devices`)."""
    planned, skipped = planned_devices(gpus, obj.spec if obj is not None else None, waiting)
    return planned, skipped, frozenset(n for names in planned.values() for n in names)


def _all_but_unhealthy(
    targets: Mapping[str, DeviceTarget],
    prepared: Collection[str],
    unreadable: Collection[int],
    hidden: Collection[str] = (),
    tainting: bool = False,
) -> set[str] | None:
    """Mode ``all``: every device, less the free ones (those not ``prepared`` on this node) of
    the ``unreadable`` GPUs; ``None`` (every placement) when every GPU reads and none is
    ``hidden`` (an XID hit them, processes outside any claim use them).  A hidden device stays
    published when ``tainting`` (the API server keeps device taints: it is published with the
    ``NoSchedule`` taint); else every free device of its GPU is withdrawn with it.  Never the
    hidden device alone: it may be allocated to a claim not prepared yet (this mode lists no
    claims), and withdrawn, its counters stopped counting, so kube-scheduler could allocate an
    overlapping placement of the same GPU to another claim (shared/facts/dra.md, consequence 1)."""
    if not unreadable and not hidden:
        return None
    gone = set(unreadable) if tainting else set(unreadable) | {targets[n].gpu for n in hidden}
    return {n for n, t in targets.items() if t.gpu not in gone} | set(prepared)


def _published_as(shaped: bool, tainting: bool, gpus: str) -> str:
    """What a round does with the devices it keeps from new claims (an XID hit them, processes
    outside any claim use them), in words: ``shaped`` publishing withdraws the free ones
    (allocated ones stay published, tainted where the API server keeps device taints); mode
    ``all`` publishes them with the ``NoSchedule`` taint where the API server keeps taints,
    else withdraws every free device of ``gpus`` (:func:`_all_but_unhealthy`)."""
    if shaped:
        kept = "tainted NoSchedule" if tainting else "untainted: the API server drops device taints"
        return (
            "are withdrawn from the ResourceSlices while free (allocated ones stay published, "
            f"{kept})"
        )
    if tainting:
        return f"stay published with the NoSchedule taint {UNUSABLE_TAINT_KEY}"
    return (
        f"are withdrawn from the ResourceSlices with every free device of {gpus} (the API server "
        "drops device taints; devices prepared here stay published)"
    )


def _xid_does(shaped: bool, tainting: bool) -> str:
    """What the DRA agent does about a critical XID, as its WARNING says."""
    return (
        "publishing now; until the agent restarts the devices it hit (that instance's placement "
        "and those sharing a memory slot with it, else every device of the GPU) "
        f"{_published_as(shaped, tainting, 'the GPU')} and new claims on them are refused: drain "
        "the node, reset the GPU or reboot, then restart the agent pod"
    )


@runtime_checkable
class ForeignCounter(Protocol):
    """Records how many foreign uses a round found (:class:`~node_agent.metrics.AgentMetrics`)."""

    def observe_foreign(self, count: int) -> None: ...


class AllocatedClaims(Protocol):
    async def allocated(self) -> set[str]:
        """The devices of this node's pool that some ResourceClaim holds."""
        ...


class DraDriver:
    def __init__(
        self,
        plugin: DraKubeletPlugin,
        publisher: SlicePublisher,
        *,
        resync_s: float = 30.0,
        retry_s: float = 2.0,
        health: AgentHealth | None = None,
        spec_source: SpecSource | None = None,
        claims: AllocatedClaims | None = None,
        spec_poll_s: float = 2.0,
        xids: XidWatcher | None = None,
        metrics: XidCounter | None = None,
        registration_grace_s: float | None = None,
    ) -> None:
        """``plugin``'s registrations, prepares and unprepares wake the publish loop (its
        ``on_registered`` and ``on_claims_changed`` are set here); its preparer is the one the
        start-up clean-up runs on.  ``spec_source`` (``get()``, ``write_status(status)``:
        :class:`~node_agent.agent.KubeSpecSource`) and ``claims`` (``allocated()``:
        :class:`~node_agent.dra_shape.ShapeApi`) turn on planner-shaped publishing.  ``xids``
        watches NVML's XID events while :meth:`run` runs (on the preparer's NVML; ``None``: not
        watched), ``metrics`` counts them.  ``registration_grace_s``: how long the plugin may
        wait for the kubelet's first registration before the node reports it (module docstring,
        "The kubelet's registration"; default: the health check's limit, else three
        ``resync_s``)."""
        if (spec_source is None) != (claims is None):
            raise ValueError("shaped publishing needs both spec_source and claims")
        self.plugin = plugin
        self.preparer = plugin.preparer
        self.publisher = publisher
        self.resync_s = resync_s
        self.retry_s = retry_s
        self.health = health
        self.spec_source = spec_source
        self.claims = claims
        self.spec_poll_s = spec_poll_s
        self.xids = xids
        self.metrics = metrics
        if registration_grace_s is None:
            registration_grace_s = health.limit_s if health is not None else 3 * resync_s
        self.registration_grace_s = registration_grace_s
        self.kubelet_problem: str | None = None
        """Why the kubelet will not call the driver, as the last round found it (module
        docstring, "The kubelet's registration"); ``None``: registered, or not waited for long."""
        self._xid_later: list[tuple[int | None, XidEvent]] = []
        """XID events of GPUs the preparer does not serve yet, with their ledger numbers, tried
        again each round."""
        if xids is not None:  # the preparer stamps the GPU instance ids it reuses
            ledger = xids.ledger
            self.preparer.xid_clock = lambda: ledger.added
        self._wake = asyncio.Event()
        plugin.on_registered = self._wake.set
        plugin.on_refused = self._wake.set
        plugin.on_claims_changed = self._on_claims_changed
        self.rounds = 0
        self.failures = 0
        self.idle_destroyed = 0
        """Idle instances outside the planned and allocated placements destroyed so far."""
        self.planned_created = 0
        """Planned placements' instances created ahead of any claim so far."""
        self.status_writes = 0
        self.published: set[str] | None = None
        """The devices the last successful shaped round published."""
        self.unreadable: dict[int, NvmlError] = {}
        """The GPUs the last round found NVML cannot read, with the error (isolated)."""
        self.foreign: list[ForeignUse] = []
        """The placements the last round found running processes outside any claim."""
        self.unmade: frozenset[str] = frozenset()
        """The planned placements the last shaped round could not make (MIG mode not switched
        on, the creation failed): withdrawn while free, reported ``unhealthy``."""
        self.lingering: frozenset[str] = frozenset()
        """The devices the last successful shaped round published only because a claim has
        them allocated, none prepared here (module docstring, "Lingering devices")."""
        self._seen: tuple[str, int, tuple[int, ...]] | None = None
        self._skipped: list[str] = []
        self._narrowed = False
        self._linger_s: float | None = None
        """The wait before the next round while some device lingers (``None``: none does)."""
        self._claims_moved = False
        """A prepare or unprepare came since the last round started."""

    @property
    def shaped(self) -> bool:
        return self.spec_source is not None

    def _sources(self) -> tuple[SpecSource, AllocatedClaims]:
        if self.spec_source is None or self.claims is None:
            raise RuntimeError("planner-shaped publishing is off (no spec_source and claims)")
        return self.spec_source, self.claims

    async def _read_gpus(self) -> dict[int, NvmlError]:
        """Start of every round: publish the GPUs unreadable since the start that read now
        (:meth:`~node_agent.dra_prepare.DraPreparer.read_pending`), turn the XID events seen
        since the last round into marks (:meth:`_take_xids`) and return the GPUs NVML cannot
        read now (:meth:`_read_unreadable`).  NVML down raises."""
        added = await asyncio.to_thread(self.preparer.read_pending)
        if added:
            self.publisher.gpus = sorted([*self.publisher.gpus, *added], key=lambda g: g.index)
        unreadable = await self._read_unreadable()
        await self._take_xids()
        return unreadable

    async def _take_xids(self) -> None:
        """Resolve the critical XID events the watcher saw since the last round into the
        preparer's marks (kept until the agent restarts)."""
        if self.xids is None:
            return
        first, new = self.xids.ledger.take_numbered()
        events = [*self._xid_later, *enumerate(new, first)]
        if events:
            self._xid_later = await asyncio.to_thread(
                self.preparer.mark_numbered_xids, events, first + len(new)
            )

    def _on_claims_changed(self) -> None:
        """After every prepare and unprepare of the plugin: a round now (the used flags, the
        idle clean-up, a device to withdraw; mode ``all``: a prepared device released), and
        the lingering devices' poll starts again at ``spec_poll_s``."""
        self._claims_moved = True
        self._wake.set()

    def _note_lingering(self, lingering: frozenset[str], moved: bool) -> None:
        """Keep this round's lingering devices and set the wait before the next round: none,
        ``spec_poll_s`` for a new set (or after a prepare or unprepare), else twice the last
        wait, at most ``resync_s``."""
        if not lingering:
            self._linger_s = None
        elif moved or lingering != self.lingering or self._linger_s is None:
            self._linger_s = self.spec_poll_s
        else:
            self._linger_s = min(self._linger_s * 2, self.resync_s)
        if lingering != self.lingering:
            log.debug(
                "published only for claims not prepared here (re-read in %s s): %s",
                self._linger_s,
                ", ".join(sorted(lingering)) or "none",
            )
        self.lingering = lingering

    def _on_xids(self, events: list[XidEvent]) -> None:
        """Count and log the XID events of one wait; a critical one wakes a round at once.
        Runs on the event loop."""
        does = _xid_does(self.shaped, self.publisher.taints)
        if self.xids is not None and report_events(events, self.xids, self.metrics, does):
            self._wake.set()

    async def _read_unreadable(self) -> dict[int, NvmlError]:
        """The GPUs NVML cannot read now (logged when the set changes); NVML down raises."""
        unreadable = await asyncio.to_thread(self.preparer.unreadable)
        if unreadable.keys() != self.unreadable.keys():
            for i, e in sorted(unreadable.items()):
                log.warning(
                    "GPU %d cannot be read by NVML (%s): its free devices are withdrawn and "
                    "nothing on it is changed until it reads again",
                    i,
                    e,
                )
            for i in sorted(self.unreadable.keys() - unreadable.keys()):
                log.info("GPU %d reads again: published and shaped as usual", i)
        self.unreadable = unreadable
        return unreadable

    async def _read_foreign(self, unreadable: Collection[int]) -> list[ForeignUse]:
        """The foreign uses now (:mod:`node_agent.dra_foreign`), kept in :attr:`foreign`;
        a WARNING when they changed."""
        foreign = await asyncio.to_thread(self.preparer.foreign_use, frozenset(unreadable))
        if foreign != self.foreign:
            if foreign:
                log.warning(
                    "processes outside any claim run on %s: those placements (and every device "
                    "sharing a memory slot with them) %s%s until the processes end",
                    "; ".join(map(str, foreign)),
                    _published_as(self.shaped, self.publisher.taints, "their GPU"),
                    " and are reported used" if self.shaped else "",
                )
            else:
                log.info("no process outside a claim runs on this node's GPUs any more")
        self.foreign = foreign
        if isinstance(self.metrics, ForeignCounter):
            self.metrics.observe_foreign(len(foreign))
        return foreign

    def _taints(
        self,
        published: Collection[str],
        unreadable: Collection[int],
        xid: Collection[str],
        busy: Collection[str],
    ) -> dict[str, str]:
        """The published devices no new claim can use, with why (module docstring,
        "Lingering devices")."""
        lost = [n for n, t in self.preparer.targets.items() if t.gpu in unreadable]
        return unusable_taints(published, unreadable=lost, xid=xid, foreign=busy)

    def _prepared(self) -> set[str]:
        """The devices of the claims the preparer prepared (its checkpoint), those prepared
        for an ``adminAccess`` result aside: they own nothing (:func:`node_agent.dra_shape.
        claim_devices`)."""
        return {
            d.device for rec in self.preparer.checkpoint for d in rec.devices if not d.admin_access
        }

    async def _shaped_round(self, kubelet: str | None = None) -> None:
        """One shaped round; ``kubelet``: why the kubelet will not call the driver (every free
        device withdrawn, the status ``Degraded``)."""
        source, claims = self._sources()
        moved, self._claims_moved = self._claims_moved, False
        obj: NodePartitioning | None = await source.get()
        draining = _draining(obj)
        self._seen = _key(obj, draining)
        unreadable = await self._read_gpus()
        gpus = self.publisher.gpus
        planned, skipped, planned_names = _planned(gpus, obj, self.preparer.pending)
        if skipped != self._skipped:
            for line in skipped:
                log.warning("NodePartitioning %s: skipped placement %s", self.publisher.node, line)
        self._skipped = skipped
        allocated: set[str] = await claims.allocated()
        prepared = self._prepared()
        allocated |= prepared
        failed = self.plugin.prepare_failures(allocated, time.monotonic())
        self.preparer.planned = planned_names
        try:
            destroyed = await asyncio.to_thread(
                self.preparer.destroy_idle, planned_names | allocated, frozenset(unreadable)
            )
        except Exception as e:  # NVML: the next round tries again; publishing goes on
            log.warning("destroying idle MIG instances the spec no longer wants failed: %s", e)
            destroyed = 0
        if destroyed:
            self.idle_destroyed += destroyed
            log.info(
                "destroyed %d idle MIG instance(s) the spec no longer wants (%d so far)",
                destroyed,
                self.idle_destroyed,
            )
        foreign = await self._read_foreign(unreadable)
        try:
            made = await asyncio.to_thread(
                self.preparer.make_planned,
                planned_names,
                frozenset(allocated),
                frozenset(unreadable) | whole_gpus(self.preparer.targets, foreign),
            )
        except Exception as e:  # NVML: prepare creates what is missing
            log.warning("creating the planned MIG instances failed: %s", e)
            made = PlannedOutcome()
        self.planned_created += made.created
        self.unmade = made.unmade
        withheld = draining | unreadable.keys()
        if kubelet is not None:
            withheld |= {g.index for g in gpus}
        xid, busy = self.preparer.xid_devices(), foreign_devices(self.preparer.targets, foreign)
        hidden = xid | busy | made.unmade
        want = publish_set(planned, allocated, withheld, hidden)
        await self.publisher.publish(want, self._taints(want, unreadable, xid, busy))
        self._narrowed = self.published is not None and bool(self.published - want)
        self.published = want
        free = publish_set(planned, (), withheld, hidden)  # what it would publish unallocated
        self._note_lingering(frozenset(want - free - prepared), moved)
        if obj is None:
            return
        status = shaped_status(
            gpus,
            self.preparer.targets,
            obj,
            planned,
            allocated,
            skipped,
            now_rfc3339(),
            unreadable,
            self.preparer.xid_marks,
            failed,
            foreign,
            mig_enabled=made.mig_enabled or None,
            mode_failed=made.mode_failed,
            not_created=made.failed,
            kubelet=Block("DriverNotRegistered", kubelet) if kubelet is not None else None,
        )
        ours = set(PARTITIONER_STATUS_FIELDS)
        if obj.status is None or status.model_dump(exclude=ours) != obj.status.model_dump(
            exclude=ours
        ):
            await source.write_status(status)
            self.status_writes += 1

    async def _spec_changed(self) -> None:
        """Return once the NodePartitioning's uid or generation differs from the last round's
        (polled every ``spec_poll_s``; a failed read is retried at the next poll)."""
        source, _ = self._sources()
        while True:
            await asyncio.sleep(self.spec_poll_s)
            try:
                key = _key(await source.get())
            except Exception as e:  # the source logs the outage; the next poll retries
                log.debug("polling the NodePartitioning failed: %s", e)
                continue
            if key != self._seen:
                return

    async def _read_planned(self) -> None:
        """Before the start-up clean-up: the spec's placements, so that it keeps them."""
        source, _ = self._sources()
        try:
            obj = await source.get()
        except Exception as e:
            log.warning(
                "reading the NodePartitioning before the start-up clean-up failed (%s): idle "
                "MIG instances no claim owns are all destroyed",
                e,
            )
            return
        self.preparer.planned = _planned(self.publisher.gpus, obj, self.preparer.pending)[2]

    def _waiting(self) -> bool:
        """The plugin waits for the kubelet's first registration, not for long yet: a round
        publishes nothing and reports nothing (module docstring, "The kubelet's
        registration")."""
        return not self.plugin.registered and self.kubelet_problem is None

    def _check_kubelet(self) -> str | None:
        """Why the kubelet will not call the driver now (:attr:`kubelet_problem`), logged when
        it changes."""
        problem = self.plugin.registration_problem(time.monotonic(), self.registration_grace_s)
        if problem != self.kubelet_problem:
            if problem is not None:
                log.error("%s", problem)
            elif self.plugin.registered and self.kubelet_problem is not None:
                log.info("the kubelet registered DRA driver %s: publishing", self.plugin.driver)
        self.kubelet_problem = problem
        return problem

    def _until_problem(self) -> float | None:
        """Seconds until a plugin that waits for its registration is reported (``None``: it
        does not wait)."""
        since = self.plugin.waiting_since
        if self.plugin.registered or self.kubelet_problem is not None or since is None:
            return None
        return max(0.0, since + self.registration_grace_s - time.monotonic()) + 0.01

    async def publish_once(self) -> bool:
        """One publish round; return whether it succeeded (:attr:`rounds` counts finished
        rounds).  While the plugin waits for the kubelet's first registration the round does
        nothing; once the kubelet refused it, or has not registered it in
        :attr:`registration_grace_s`, every free device is withdrawn and ``/readyz`` (not
        ``/healthz``) learns why (module docstring, "The kubelet's registration")."""
        kubelet = self._check_kubelet()
        waiting = self._waiting()
        if self.health is not None:  # readiness only: a restart cannot fix the kubelet
            self.health.not_ready(self._waiting_text() if waiting else kubelet)
        if waiting:
            self.rounds += 1
            if self.health is not None:
                self.health.record(True)
            return True
        try:
            if self.shaped:
                await self._shaped_round(kubelet)
            else:
                self.plugin.prepare_failures(None, time.monotonic())  # stale ones go: the gauge
                unreadable = await self._read_gpus()
                foreign = await self._read_foreign(unreadable)
                xid = self.preparer.xid_devices()
                busy = foreign_devices(self.preparer.targets, foreign)
                prepared = self._prepared()
                # the kubelet will not call the driver: every GPU's free devices withdrawn
                gone = set(unreadable) if kubelet is None else set(self.preparer.models)
                for _ in range(2):  # again at once if this round learnt taints are dropped
                    tainting = self.publisher.taints
                    every = _all_but_unhealthy(
                        self.preparer.targets, prepared, gone, xid | busy, tainting
                    )
                    # ``None``: every placement, none of them unusable
                    taints = (
                        self._taints(every, unreadable, xid, busy) if every is not None else None
                    )
                    await self.publisher.publish(every, taints)
                    if self.publisher.taints == tainting:
                        break
        except Exception as e:  # PublishError, NVML down, a connection, a timeout: go on
            self.rounds += 1
            self.failures += 1
            log.warning("publishing ResourceSlices failed (will retry): %s", e)
            if self.health is not None:
                self.health.record(False, str(e))
            return False
        self.rounds += 1
        if self.health is not None:
            self.health.record(True)
        return True

    def _waiting_text(self) -> str:
        """What ``/readyz`` says while the plugin waits for its first registration."""
        p = self.plugin
        return (
            f"waiting for the kubelet to register DRA driver {p.driver} (registration socket "
            f"{p.registration_socket}); nothing is published until it does"
        )

    async def run(self, stop: asyncio.Event) -> None:
        if self.shaped:
            await self._read_planned()
        kept = await asyncio.to_thread(self.preparer.clean_unknown)
        for line in kept:
            log.warning("kept a MIG instance no claim owns, because it is in use: %s", line)
        await self.plugin.start()
        try:
            async with watching(self.xids, self._on_xids):
                await self._loop(stop)
        finally:
            await self.plugin.stop()

    async def _loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self._wake.clear()  # a registration, a claim or an XID from now on wakes the wait
            ok = await self.publish_once()
            waits: list[Awaitable[object]] = [stop.wait(), self._wake.wait()]
            timeout = self.resync_s if ok else self.retry_s
            if (until := self._until_problem()) is not None:
                timeout = min(timeout, until)  # the wait for the kubelet turns into a problem
            if self.shaped and not self._waiting():
                waits.append(self._spec_changed())
                if ok and self._narrowed:
                    timeout = min(timeout, self.spec_poll_s)
                if ok and self._linger_s is not None:
                    timeout = min(timeout, self._linger_s)
            await first_of(*waits, timeout=timeout)
