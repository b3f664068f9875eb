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
* **Health**: every pass advertises the marked devices ``Unhealthy`` (:func:`unhealthy_ids`),
  and the status is ``Degraded`` with a block ``GpuXid`` per GPU naming the instance and the
  XID (:func:`xid_blocks`).  Pods that hold a marked device keep it.  **Nothing is created,
  destroyed or restarted because of an XID** (the agent never touches a slice in use; the MPS
  daemon of a marked GPU keeps running); the GPU is reconciled to its spec as before.

**A mark stays until the agent restarts**, as in NVIDIA's plugin: NVML reports no "recovered"
event, and a device that threw a double-bit ECC error or fell off the bus needs a GPU reset (or
a reboot) that the agent does not do while pods may use it.  Recovery: drain the node (or the
GPU's pods), reset the GPU (``nvidia-smi -r -i <bus id>``) or reboot the node, then restart the
agent pod (``kubectl -n <ns> delete pod <agent pod>``); the new agent starts with no marks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from contract.nodepartitioning import ActualGpu
from node_agent.gpu_plan import Block, ObservedGpu
from node_agent.nvml import Nvml, NvmlError, XidEvent

__all__ = [
    "APPLICATION_XIDS",
    "XidLedger",
    "XidMark",
    "XidWatcher",
    "resolve",
    "unhealthy_ids",
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

    def add(self, event: XidEvent) -> None:
        with self._lock:
            self._new.append(event)

    def take(self) -> list[XidEvent]:
        """The events added since the last call, oldest first."""
        with self._lock:
            out, self._new = self._new, []
        return out


@dataclass(frozen=True, slots=True)
class XidMark:
    """Devices one critical XID hit (see "What is marked" in the module docstring)."""

    gpu: int
    xid: int
    gpu_uuid: str
    device: str = ""
    """The MIG device UUID of the instance hit; ``""``: the whole GPU."""
    where: str = ""
    """The instance hit, in words (``""``: the whole GPU)."""


def resolve(
    events: Sequence[XidEvent], observed: Sequence[ObservedGpu], known: Sequence[ActualGpu]
) -> tuple[list[XidMark], list[XidEvent]]:
    """Marks for ``events`` against the GPUs read this pass (``observed``) and the last known
    state of the unreadable ones (``known``: their instances cannot be told apart, so the whole
    GPU); the events of a GPU in neither are returned to try again next pass."""
    by_index = {g.info.index: g for g in observed}
    lost = {g.index: g for g in known}
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


def unhealthy_ids(marks: Collection[XidMark], actual: Sequence[ActualGpu]) -> set[str]:
    """The ids of the advertised devices ``marks`` hit, in the actual state ``actual``."""
    if not marks:
        return set()
    whole = {(m.gpu_uuid or m.gpu) for m in marks if not m.device}
    devices = {m.device for m in marks if m.device}
    out: set[str] = set()
    for g in actual:
        every = (g.uuid or g.index) in whole
        if every:
            out |= {s.deviceId for s in g.mps}
        for inst in g.mig:
            if every or inst.deviceId in devices:
                out.add(inst.deviceId)
                out |= {s.deviceId for s in inst.mps}
    out.discard("")
    return out


def xid_blocks(marks: Sequence[XidMark]) -> dict[int, Block]:
    """The ``Degraded`` block ``GpuXid`` of every marked GPU, naming each instance and XID."""
    by_gpu: dict[int, list[str]] = {}
    for m in marks:
        what = f"{xid_text(m.xid)} on " + (m.where or "the whole GPU")
        said = by_gpu.setdefault(m.gpu, [])
        if what not in said:
            said.append(what)
    return {
        gpu: Block(
            "GpuXid",
            f"GPU {gpu}: NVML reported {', '.join(said)}; the devices hit are advertised "
            f"Unhealthy {RECOVERY}",
        )
        for gpu, said in sorted(by_gpu.items())
    }


Report = Callable[[list[XidEvent]], None]
"""Receives the events of one wait (critical and ignored), from the watcher's thread."""


class XidWatcher:
    """Registers the GPUs and waits for their XID events (see the module docstring)."""

    def __init__(
        self,
        nvml: Nvml,
        ledger: XidLedger,
        *,
        ignore: Collection[int] = (),
        wait_ms: int = 500,
    ) -> None:
        self._nvml = nvml
        self.ledger = ledger
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
