"""XID critical errors: the devices NVML says are hit are advertised Unhealthy until a restart.

Model
-----
The driver reports an *XID* for GPU faults: a double-bit ECC error (48), a GPU fallen off the
bus (79), a row-remapping failure (64), ... and for application faults that leave the GPU
healthy.  Like NVIDIA's own device plugin (``internal/rm/health.go``) the agent watches NVML's
XID critical-error events and stops handing the devices they hit to new pods:

* **Watching** (:class:`XidWatcher`): :meth:`~node_agent.nvml.Nvml.watch_xids` registers every
  GPU once, at the start of :meth:`node_agent.agent.Agent.run`; a GPU that cannot report XIDs
  (``NOT_SUPPORTED``) or whose registration fails is logged once and not watched.  A worker
  thread then waits in :meth:`~node_agent.nvml.Nvml.xid_events` (``wait_ms`` at a time, so it
  sees the agent stop) for the whole life of the loop, beside the passes -- NVML is thread-safe,
  and the wait touches nothing a pass uses.  A wait that fails is logged (WARNING the first time
  in a row) and tried again ``wait_ms`` later; unlike NVIDIA's plugin it marks nothing: a GPU
  that can no longer be read is isolated by the reconcile pass (``GpuUnreadable``).
* **Ignored codes**: application errors, after which the GPU is still healthy, change nothing --
  :data:`APPLICATION_XIDS` (13, 31, 43, 45, 68, 109: NVIDIA's plugin's list) plus the agent
  setting ``xid_ignore`` (``GPUSLICE_XID_IGNORE``, comma-separated; chart ``agent.xidIgnore``).
  They are counted and logged at INFO only.
* **Critical events** go into the :class:`XidLedger` the reconciler reads, are logged at WARNING
  and counted (``gpuslice_agent_xid_errors_total{gpu,xid}``, ignored ones too), and wake a
  reconcile pass at once, so the kubelet hears of them within a second.
* **What is marked** (:func:`resolve`, at the first pass after the event): an event scoped to a
  MIG instance (GI id given) marks that instance -- the MIG device the agent advertises for it,
  by UUID, or, on a hybrid GPU, the MPS slices it hosts; an event not MIG-scoped, or one naming
  a GPU instance the GPU no longer has, marks every device of its GPU (by GPU UUID: MIG
  instances, hosted slices, MPS slices, also those created later); an event whose GPU the
  adapter could not tell marks every GPU.  Marks are kept by identity (GPU or MIG device UUID),
  so a MIG device created later on a healthy GPU is not affected.
* **GPU instance ids the agent reused** (``changed`` of :func:`resolve`): the driver reuses GI
  ids, and an event names its instance only by GI id.  An event that arrives while a pass
  destroys a GI and creates another with the same id may be about either.  The reconciler
  therefore records the GI ids each pass destroys or creates, and the ledger's count of events
  (:attr:`XidLedger.added`) once the pass has made its changes; an event the ledger got before
  that point (:meth:`XidLedger.take_numbered`) that names one of those ids marks the **whole
  GPU** (the block says why), never the new instance by guess.  Created ids count too, not only
  destroyed ones: the event may be about an instance that existed under that id before.  An
  event that arrives after the pass is resolved as usual, against the instances read at the
  next pass.  This is the safe choice: a new, healthy instance is never blamed while the one
  hit stays in service; the price is that, in this rare race, the GPU's other devices are
  marked too (until the restart, like any mark).  Resolving the GI id to a MIG UUID in the
  watcher thread when the event arrives was not chosen: NVML hands the event over after the
  fact, so the watcher's read could already see the new instance -- the same race, only
  narrower -- and it would read instances while a pass changes them.
* **Health**: every pass advertises the marked devices ``Unhealthy`` (:func:`unhealthy_ids`,
  over :func:`device_ids`, the one walk of a GPU's device ids, which the reconciler's lost GPUs
  use too), and the status is ``Degraded`` with a block ``GpuXid`` per GPU naming the instance
  and the XID (:func:`xid_blocks`, :func:`add_xid_blocks`).  Pods that hold a marked device
  keep it.  **Nothing is created, destroyed or restarted because of an XID** (the agent never
  touches a slice in use; the MPS daemon of a marked GPU keeps running); the GPU is reconciled
  to its spec as before.
* **Both agents**: :func:`watching` runs the watcher's thread for the device-plugin agent
  (:class:`~node_agent.agent.Agent`) and the DRA agent (:class:`~node_agent.dra_driver.DraDriver`),
  and :func:`report_events` counts and logs each wait's events for both.  The DRA agent resolves
  the events itself, by placement (:meth:`~node_agent.dra_prepare.DraPreparer.mark_xids`): its
  devices are placements, and it keeps those an XID hit from new claims -- shaped publishing
  withdraws the free ones from its ResourceSlices, mode ``all`` publishes them with the
  ``NoSchedule`` unusable taint where the API server keeps device taints, else withdraws their
  GPU's free devices (:mod:`node_agent.dra_driver`).
* **Off switch**: the setting ``xid_watch`` (``GPUSLICE_XID_WATCH``, chart ``agent.xidWatch``,
  default true) false builds the watcher with ``enabled=False``: :func:`watching` then starts no
  thread and registers nothing (one INFO line says so), for a driver whose NVML event sets
  misbehave -- NVIDIA's device plugin offers ``DP_DISABLE_HEALTHCHECKS`` for the same.

**A mark stays until the agent restarts**, as in NVIDIA's plugin: NVML reports no "recovered"
event, and a device that threw a double-bit ECC error or fell off the bus needs a GPU reset (or
a reboot) that the agent does not do while pods may use it.  Recovery: drain the node (or the
GPU's pods), reset the GPU (``nvidia-smi -r -i <bus id>``) or reboot the node, then restart the
agent pod (``kubectl -n <ns> delete pod <agent pod>``); the new agent starts with no marks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from contract.nodepartitioning import ActualGpu
from node_agent.gpu_plan import Block, ObservedGpu
from node_agent.nvml import Nvml, NvmlError, XidEvent

__all__ = [
    "APPLICATION_XIDS",
    "XidLedger",
    "XidMark",
    "XidWatcher",
    "add_xid_blocks",
    "device_ids",
    "report_events",
    "resolve",
    "unhealthy_ids",
    "watching",
    "xid_blocks",
    "xid_text",
]

log = logging.getLogger("gpuslice.agent.xid")

APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
"""Application errors that leave the GPU healthy (NVIDIA's device plugin ignores them too):
graphics engine exception, GPU memory page fault, GPU stopped processing, preemptive cleanup,
video processor exception, context switch timeout."""

_MEANING = {
    48: "double-bit ECC error",
    63: "ECC page retirement or row remapping",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}

RECOVERY = (
    "until the agent restarts: drain the node, reset the GPU (nvidia-smi -r) or reboot, then "
    "restart the agent pod"
)


def xid_text(xid: int) -> str:
    """``XID 48 (double-bit ECC error)``; the bare code when its meaning is not listed here."""
    meaning = _MEANING.get(xid)
    return f"XID {xid} ({meaning})" if meaning else f"XID {xid}"


class XidLedger:
    """Critical XID events the watcher saw and no pass has resolved yet (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._new: list[XidEvent] = []
        self._added = 0

    def add(self, event: XidEvent) -> None:
        with self._lock:
            self._new.append(event)
            self._added += 1

    @property
    def added(self) -> int:
        """How many events were ever added: the number the next one gets (from 0)."""
        with self._lock:
            return self._added

    def take(self) -> list[XidEvent]:
        """The events added since the last call, oldest first."""
        return self.take_numbered()[1]

    def take_numbered(self) -> tuple[int, list[XidEvent]]:
        """The events added since the last take, oldest first, and the number of the first
        (events are numbered from 0 in the order they were added; see :attr:`added`)."""
        with self._lock:
            out, self._new = self._new, []
            return self._added - len(out), out


@dataclass(frozen=True, slots=True)
class XidMark:
    """Devices one critical XID hit (see "What is marked" in the module docstring)."""

    gpu: int
    xid: int
    gpu_uuid: str
    device: str = ""
    """The device of the instance hit: its MIG device UUID (the device-plugin agent,
    :func:`resolve`) or its placement's device name (the DRA agent,
    :meth:`~node_agent.dra_prepare.DraPreparer.mark_xids`); ``""``: the whole GPU."""
    where: str = ""
    """The instance hit, in words (``""``: the whole GPU; a whole-GPU mark may also say why in
    words here, with ``device`` empty)."""


def resolve(
    events: Sequence[XidEvent],
    observed: Sequence[ObservedGpu],
    known: Sequence[ActualGpu],
    changed: Mapping[int, Collection[int]] | None = None,
) -> tuple[list[XidMark], list[XidEvent]]:
    """Marks for ``events`` against the GPUs read this pass (``observed``) and the last known
    state of the unreadable ones (``known``: their instances cannot be told apart, so the whole
    GPU); the events of a GPU in neither are returned to try again next pass.  ``changed``:
    GPU index -> the GI ids a pass destroyed or created while these events may have come in:
    an event naming one marks the whole GPU (module docstring)."""
    by_index = {g.info.index: g for g in observed}
    lost = {g.index: g for g in known}
    changed = changed or {}
    marks: list[XidMark] = []
    later: list[XidEvent] = []
    for e in events:
        gpus = [e.gpu] if e.gpu is not None else sorted({*by_index, *lost})
        for i in gpus:
            g = by_index.get(i)
            if g is None:
                if i in lost:
                    marks.append(XidMark(i, e.xid, lost[i].uuid))
                else:
                    later.append(e)
                continue
            inst = None
            if e.gi_id is not None and e.gi_id in changed.get(i, ()):
                where = (
                    f"the whole GPU (GPU instance {e.gi_id} was destroyed or created while the "
                    "event came in, so the instance hit cannot be told)"
                )
                marks.append(XidMark(i, e.xid, g.info.uuid, "", where))
                continue
            if e.gi_id is not None and g.info.mig_enabled:
                inst = next((x for x in g.instances if x.gi_id == e.gi_id and x.uuid), None)
            if inst is None:
                marks.append(XidMark(i, e.xid, g.info.uuid))
            else:
                where = (
                    f"MIG instance {inst.name} at memory slot {inst.start} (GPU instance "
                    f"{inst.gi_id}, {inst.uuid})"
                )
                marks.append(XidMark(i, e.xid, g.info.uuid, inst.uuid, where))
    return marks, later


def device_ids(gpu: ActualGpu, instances: Collection[str] | None = None) -> set[str]:
    """The ids of the devices the device-plugin agent advertises for ``gpu`` (an actual state):
    its MIG instances, the MPS slices they host (hybrid) and its own MPS slices; with
    ``instances``, only the MIG instances whose device id is in it and the slices they host.
    (The one walk of a GPU's device ids: the XID marks and the reconciler's lost GPUs use it.)"""
    out: set[str] = set() if instances is not None else {s.deviceId for s in gpu.mps}
    for inst in gpu.mig:
        if instances is None or inst.deviceId in instances:
            out.add(inst.deviceId)
            out |= {s.deviceId for s in inst.mps}
    out.discard("")
    return out


def unhealthy_ids(marks: Collection[XidMark], actual: Sequence[ActualGpu]) -> set[str]:
    """The ids of the advertised devices ``marks`` hit, in the actual state ``actual``."""
    if not marks:
        return set()
    whole = {(m.gpu_uuid or m.gpu) for m in marks if not m.device}
    devices = {m.device for m in marks if m.device}
    out: set[str] = set()
    for g in actual:
        out |= device_ids(g, None if (g.uuid or g.index) in whole else devices)
    return out


ADVERTISED_UNHEALTHY = "the devices hit are advertised Unhealthy"
"""What a ``GpuXid`` block says became of the devices hit (the device-plugin agent)."""


def xid_blocks(marks: Sequence[XidMark], devices: str = ADVERTISED_UNHEALTHY) -> dict[int, Block]:
    """The ``Degraded`` block ``GpuXid`` of every marked GPU, naming each instance and XID;
    ``devices`` says what became of the devices hit (the DRA agent's shaped publishing
    withdraws the free ones: :data:`node_agent.dra_shape.XID_DEVICES`)."""
    by_gpu: dict[int, list[str]] = {}
    for m in marks:
        what = f"{xid_text(m.xid)} on " + (m.where or "the whole GPU")
        said = by_gpu.setdefault(m.gpu, [])
        if what not in said:
            said.append(what)
    return {
        gpu: Block("GpuXid", f"GPU {gpu}: NVML reported {', '.join(said)}; {devices} {RECOVERY}")
        for gpu, said in sorted(by_gpu.items())
    }


def add_xid_blocks(
    blocks: dict[int, Block], marks: Sequence[XidMark], devices: str = ADVERTISED_UNHEALTHY
) -> None:
    """Give every GPU an XID hit its ``GpuXid`` block (:func:`xid_blocks`); a GPU with another
    permanent block keeps it, with the XID added to its message (a transient one gives way:
    Degraded wins)."""
    for i, xid in xid_blocks(marks, devices).items():
        had = blocks.get(i)
        if had is None or had.transient:
            blocks[i] = xid
        else:
            blocks[i] = replace(had, message=f"{had.message}; {xid.message}")


Report = Callable[[list[XidEvent]], None]
"""Receives the events of one wait (critical and ignored)."""


class XidWatcher:
    """Registers the GPUs and waits for their XID events (see the module docstring)."""

    def __init__(
        self,
        nvml: Nvml,
        ledger: XidLedger,
        *,
        ignore: Collection[int] = (),
        wait_ms: int = 500,
        enabled: bool = True,
    ) -> None:
        self._nvml = nvml
        self.ledger = ledger
        self.enabled = enabled
        """The ``xid_watch`` setting: ``False`` starts no watcher thread (:func:`watching`)."""
        self.ignored = APPLICATION_XIDS | frozenset(ignore)
        """XID codes that change nothing: application errors and the ``xid_ignore`` setting."""
        self.wait_ms = wait_ms
        self.watched: tuple[int, ...] = ()
        """The GPUs that report XID events (after :meth:`start`)."""

    def critical(self, xid: int) -> bool:
        return xid not in self.ignored

    def start(self) -> bool:
        """Register every GPU for XID events, logging once each GPU that cannot report them.
        Returns whether any GPU is watched."""
        try:
            reg = self._nvml.watch_xids()
        except NvmlError as e:
            log.warning("XID errors are not watched: NVML cannot register events (%s)", e)
            return False
        for i in reg.unsupported:
            log.warning(
                "GPU %d cannot report XID errors (NVML: NOT_SUPPORTED): its devices are not "
                "marked Unhealthy on an XID",
                i,
            )
        for i, err in reg.failed:
            log.warning(
                "GPU %d: registering for XID errors failed (%s): its devices are not marked "
                "Unhealthy on an XID",
                i,
                err,
            )
        self.watched = reg.registered
        if reg.registered:
            log.info(
                "watching XID errors of GPU(s) %s; ignoring XIDs %s",
                ", ".join(map(str, reg.registered)),
                ", ".join(map(str, sorted(self.ignored))),
            )
        return bool(reg.registered)

    def poll(self) -> list[XidEvent]:
        """One wait (at most ``wait_ms``): the events that came, the critical ones also added to
        the ledger.  Raises :class:`~node_agent.nvml.NvmlError` if the wait fails."""
        events = self._nvml.xid_events(self.wait_ms)
        for e in events:
            if self.critical(e.xid):
                self.ledger.add(e)
        return events

    def run(self, stop: threading.Event, report: Report) -> None:
        """Register, then wait for events until ``stop`` is set, passing each wait's events to
        ``report`` (after they are in the ledger).  Runs in a worker thread."""
        if not self.start():
            return
        failing = 0
        while not stop.is_set():
            try:
                events = self.poll()
            except Exception as e:  # NvmlError, or anything the binding raises: retried
                failing += 1
                level = logging.WARNING if failing == 1 else logging.DEBUG
                log.log(level, "waiting for XID events failed (%d in a row): %s", failing, e)
                stop.wait(self.wait_ms / 1000)
                continue
            if failing:
                log.info("waiting for XID events works again after %d failure(s)", failing)
                failing = 0
            if events:
                report(events)


class XidCounter(Protocol):
    """Counts XID events (:class:`~node_agent.metrics.AgentMetrics`)."""

    def observe_xid(self, event: XidEvent) -> None: ...


def report_events(
    events: Sequence[XidEvent],
    watcher: XidWatcher,
    metrics: XidCounter | None,
    consequence: str,
) -> bool:
    """Count every event of one wait (``gpuslice_agent_xid_errors_total``), log an ignored one
    at INFO and a critical one at WARNING with ``consequence`` (what the agent does about it,
    in words); return whether any was critical (the caller wakes its pass or round)."""
    critical = False
    for e in events:
        if metrics is not None:
            metrics.observe_xid(e)
        gpu = "an unknown GPU" if e.gpu is None else f"GPU {e.gpu}"
        scope = (
            f", GPU instance {e.gi_id} / compute instance {e.ci_id}" if e.gi_id is not None else ""
        )
        if not watcher.critical(e.xid):
            log.info(
                "%s on %s%s: ignored (an application error, or in GPUSLICE_XID_IGNORE); "
                "its devices stay Healthy",
                xid_text(e.xid),
                gpu,
                scope,
            )
            continue
        critical = True
        log.warning("%s on %s%s: %s", xid_text(e.xid), gpu, scope, consequence)
    return critical


@contextlib.asynccontextmanager
async def watching(watcher: XidWatcher | None, on_events: Report) -> AsyncIterator[None]:
    """Run ``watcher`` (:meth:`XidWatcher.run`) in a worker thread while the body runs, handing
    each wait's events to ``on_events`` on the event loop; on the way out the thread is told to
    stop and awaited (it ends within ``wait_ms``).  No watcher, or one switched off (setting
    ``xid_watch``), starts no thread: nothing is registered and no XID is seen.  Both agents
    (:class:`~node_agent.agent.Agent`, :class:`~node_agent.dra_driver.DraDriver`) use it."""
    if watcher is None:
        yield
        return
    if not watcher.enabled:
        log.info(
            "XID errors are not watched (GPUSLICE_XID_WATCH=false): a GPU or MIG instance an "
            "XID hits stays in service"
        )
        yield
        return
    loop = asyncio.get_running_loop()
    halt = threading.Event()

    def report(events: list[XidEvent]) -> None:  # in the watcher's thread
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to wake
            loop.call_soon_threadsafe(on_events, events)

    thread = asyncio.ensure_future(asyncio.to_thread(watcher.run, halt, report))
    try:
        yield
    finally:
        halt.set()  # the thread ends after its current wait (at most wait_ms)
        try:
            await asyncio.shield(thread)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("the XID watcher failed")
