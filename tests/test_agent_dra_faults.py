"""Randomised fault tests of the DRA node agent's preparer on the fake NVML.

The DRA counterpart of ``tests/test_agent_faults.py``, at the :class:`DraPreparer` level (no
gRPC, no API server).  Each sequence builds a node of 1-3 GPUs (A100-SXM4-80GB, whose MIG-mode
changes wait for a GPU reset, and H100-80GB, where they are immediate and lost at reboot), a
checkpoint and CDI directory on disk, and runs 6-16 random steps, each one of:

* a new claim whose devices the ResourceSlice counters allow beside every allocated one
  (:func:`fits`), drawn from what the last round published (sometimes from every device: an
  allocation made against an older publication), prepared at once.  The allocation stands
  whatever prepare answers: the kubelet (:class:`Claim`) retries prepare in later steps until
  it succeeds or the claim is deallocated;
* an allocation the counters refuse beside the *prepared* claims (what the preparer knows of;
  half the time over one of their devices): prepare must fail and touch nothing prepared; the
  kubelet then unprepares it;
* a pod process starting on a prepared claim's device, or ending;
* a stray process (outside any claim) starting on an idle instance no claim owns, or on a
  GPU with MIG off no claim holds, or ending;
* the pod of a claim finishing: unprepare (refused while processes still run on its devices;
  the kubelet retries it in later steps, the stragglers ending at some point);
* a new spec (per GPU a valid layout of the planner's, :func:`planner.geometry.enumerate_layouts`,
  mostly keeping the allocated placements as the planner does, sometimes not; or no MIG
  instance; or no NodePartitioning at all);
* NVML faults on random operations (UNKNOWN, TIMEOUT, IN_USE, INSUFFICIENT_RESOURCES, now and
  then NVML down; once, or for the step with some probability; before the call takes effect
  or after it), a GPU lost
  (``GPU_IS_LOST`` on every call of one GPU for 1-4 steps), an agent crash armed on a random
  operation (:class:`AgentCrash`: the preparer object is dropped and a new one starts from the
  checkpoint file, sets the spec's placements and runs ``clean_unknown``, as
  :meth:`DraDriver.run <node_agent.dra_driver.DraDriver.run>` does), an agent restart, a node
  reboot (:meth:`FakeNvml.reboot`: instances and processes gone, then a restart; the kubelet
  prepares every claim again, after 0-2 steps), an XID (:meth:`DraPreparer.mark_xids`).

After the step's action the kubelet retries what it has pending and a shaped round runs, in the
order of ``DraDriver._shaped_round``: ``read_pending``, ``unreadable``, ``planned`` set,
``destroy_idle(planned | allocated, unreadable)``, ``foreign_use(unreadable)``,
``create_planned(planned, allocated, unreadable | whole_gpus(...))``, ``publish_set``; failures
of the clean-up and creation are logged and the round goes on, an NVML error elsewhere fails
the round (nothing published), as in the driver.

Checked after every step (a violation fails the test with the seed and the sequence's trace):

1. nothing in use is destroyed: a MIG device (UUID) that a ``completed`` checkpoint record owns
   or a process runs on is still there after the step, unless the node rebooted, the kubelet
   unprepared that claim, or the processes ended in the step;
2. every claim the kubelet saw prepared (since the last reboot) keeps its devices: the same
   UUIDs, at exactly the allocated profile and start (a whole GPU: MIG off);
3. no two checkpoint records share a memory slot of a GPU;
4. the published set never holds a free device sharing a memory slot with an instance (or a
   GPU with MIG off) that runs a stray process;
5. after the faults stop (faults cleared, stray processes and stragglers ended, the agent
   restarted if an XID marked something, 5 rounds of kubelet retries and shaped rounds): every
   claim still allocated is prepared, every planned placement the counters allow beside the
   allocated devices exists with its compute instance, and no instance is left outside the
   planned and allocated placements.

Why seeded sequences and not hypothesis: faults fire inside the agent's NVML calls at random
points and crashes rebuild the agent from a file, so a shrunk example is rarely simpler than
the seed that failed; a failing seed is rerun alone with ``GPUSLICE_DRA_FAULT_FIRST_SEED=<seed>
GPUSLICE_DRA_FAULT_SEQUENCES=1`` and its trace is in the message.  ``GPUSLICE_DRA_FAULT_SEQUENCES``
(default 1500, 20-35 s on two cores) sets how many run; the counts are printed and each kind
of event must occur in proportion to the sequences run.  The bugs the sequences found have a
deterministic reproduction each at the end of the file.
"""

from __future__ import annotations

import logging
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import pytest

from node_agent.dra_checkpoint import Checkpoint, ClaimRecord
from node_agent.dra_claims import AllocatedDevice, ClaimError, ClaimRef, DeviceTarget
from node_agent.dra_claims import device_targets as _device_targets
from node_agent.dra_foreign import foreign_devices, whole_gpus
from node_agent.dra_prepare import DraPreparer
from node_agent.dra_shape import publish_set
from node_agent.dra_slices import device_name, gpu_counters, placement_counters, reported_layout
from node_agent.nvml import NvmlError, NvmlErrorCode, XidEvent
from node_agent.nvml_fake import OPS, FakeNvml
from planner.catalog import GpuModel, default_catalog
from planner.geometry import Placement, enumerate_layouts

SEQUENCES = int(os.environ.get("GPUSLICE_DRA_FAULT_SEQUENCES", "1500"))
FIRST_SEED = int(os.environ.get("GPUSLICE_DRA_FAULT_FIRST_SEED", "0"))
CAT = default_catalog()
A100 = CAT.model("A100-SXM4-80GB")
H100 = CAT.model("H100-80GB")
NODE = "node-a"
MUTATING = ("set_mig_mode", "reset_gpu", "set_compute_mode", "create_gpu_instance",
            "create_compute_instance", "destroy_compute_instance", "destroy_gpu_instance")  # fmt: skip
CODES = (NvmlErrorCode.UNKNOWN, NvmlErrorCode.TIMEOUT, NvmlErrorCode.IN_USE,
         NvmlErrorCode.INSUFFICIENT_RESOURCES)  # fmt: skip
FINAL_ROUNDS = 5

T = TypeVar("T")


class AgentCrash(BaseException):
    """The agent process dies (not an Exception: nothing in the agent may swallow it)."""


class Violation(AssertionError):
    pass


@cache
def layouts(model: GpuModel) -> tuple[tuple[Placement, ...], ...]:
    return tuple(enumerate_layouts(model))


@cache
def layouts_with(
    model: GpuModel, pinned: frozenset[tuple[str, int]]
) -> list[tuple[Placement, ...]]:
    """The layouts of ``model`` holding every pinned (profile, start)."""
    return [lay for lay in layouts(model) if pinned <= {(p.profile.name, p.start) for p in lay}]


def slots(t: DeviceTarget) -> set[int] | None:
    """The memory slots of a device; ``None``: every slot of its GPU."""
    return None if t.profile is None else set(t.profile.span(t.start))


def overlap(a: DeviceTarget, b: DeviceTarget) -> bool:
    if a.gpu != b.gpu:
        return False
    sa, sb = slots(a), slots(b)
    return sa is None or sb is None or bool(sa & sb)


def fits(models: list[GpuModel], targets: dict[str, DeviceTarget], names: list[str]) -> bool:
    """The scheduler's counter check (facts/dra.md section 2) over a set of devices."""
    used: dict[tuple[int, str], int] = {}
    for name in names:
        t = targets[name]
        for k, v in placement_counters(models[t.gpu], t.profile, t.start).items():
            used[(t.gpu, k)] = used.get((t.gpu, k), 0) + v
    return all(v <= gpu_counters(models[g])[k] for (g, k), v in used.items())


def ref(n: int) -> ClaimRef:
    return ClaimRef("team", f"claim-{n}", f"uid-{n:04d}")


@dataclass
class Claim:
    """One allocated claim as the kubelet sees it."""

    n: int
    devices: list[str]
    prepared: dict[str, str] | None = None
    """Device -> UUID of the last successful prepare since the last reboot; ``None``: the
    kubelet has to (re)prepare it."""
    pids: list[int] = field(default_factory=list)
    """Its pod's processes."""
    releasing: bool = False
    """The pod is done: the kubelet unprepares it until that succeeds."""

    @property
    def uid(self) -> str:
        return ref(self.n).uid

    def allocation(self) -> list[AllocatedDevice]:
        return [AllocatedDevice(f"r{i}", NODE, d) for i, d in enumerate(self.devices)]


@dataclass
class Stats:
    sequences: int = 0
    steps: int = 0
    rounds: int = 0
    rounds_failed: int = 0
    nvml_calls: int = 0
    faults: int = 0
    crashes: int = 0
    restarts: int = 0
    failed_starts: int = 0
    starts_with_lost_gpu: int = 0
    reboots: int = 0
    lost_gpus: int = 0
    xids: int = 0
    xid_restarts: int = 0
    claims: int = 0
    prepares: int = 0
    prepare_failures: int = 0
    reprepared_after_reboot: int = 0
    kubelet_reprepares: int = 0
    adopted: int = 0
    stale_refused: int = 0
    unprepares: int = 0
    unprepare_refused_busy: int = 0
    unprepare_failures: int = 0
    pod_processes: int = 0
    strays: int = 0
    stray_instances_withdrawn: int = 0
    specs: int = 0
    idle_destroyed: int = 0
    planned_created: int = 0
    claims_checked: int = 0
    planned_checked: int = 0
    violations: list[str] = field(default_factory=list)


class Sequence:
    def __init__(self, seed: int, st: Stats, tmp: Path) -> None:
        self.seed = seed
        self.st = st
        self.rng = rng = random.Random(seed)
        self.models: list[GpuModel] = [
            rng.choice((A100, H100)) for _ in range(rng.choice((1, 2, 2, 3)))
        ]
        self.nv = FakeNvml(self.models, mig_enabled=rng.random() < 0.5, rng=random.Random(~seed))
        self.targets = _device_targets(dict(enumerate(self.models)))
        self.names = sorted(self.targets)
        self.dir = tmp
        self.prep: DraPreparer | None = None
        self.claims: dict[int, Claim] = {}
        self.next = 0
        self.kubelet_late = 0
        """Steps before the kubelet retries again (it restarts after a reboot)."""
        self.stale: set[int] = set()
        """Claims of allocations the counters refused, for the kubelet to unprepare."""
        self.strays: dict[int, tuple[int, int | None]] = {}
        """Stray pid -> (GPU, GI id or ``None``: the whole GPU)."""
        self.spec: dict[int, list[str]] | None = None
        """The NodePartitioning's placements per GPU (device names); ``None``: no object."""
        self.published: set[str] | None = None
        self.lost: dict[int, tuple[Any, int]] = {}
        """GPU -> (its GPU_IS_LOST fault, steps left)."""
        self.trace: list[str] = []
        self.rebooted = False
        self.unprepared: set[int] = set()
        """Claims the kubelet called unprepare for in this step."""
        self.where: dict[int, tuple[int, int | None]] = {}
        """Every process started -> (GPU, GI id or ``None``)."""
        self.freed: set[str] = set()
        """MIG devices a process ended on in this step."""
        self.prepared_before: dict[int, dict[str, str]] = {}
        """Claim -> its prepared devices before the step."""

    # -- the agent ---------------------------------------------------------------------

    def log(self, line: str) -> None:
        self.trace.append(line)

    def fail(self, what: str) -> NoReturn:
        raise Violation(
            f"seed {self.seed}: {what}\nGPUs {[m.name for m in self.models]}\ntrace:\n  "
            + "\n  ".join(self.trace[-60:])
        )

    def planned_names(self, prep: DraPreparer) -> frozenset[str]:
        """The spec's placements on the GPUs the agent serves (``_planned`` of the driver:
        those of GPUs unreadable since the start are left out)."""
        if self.spec is None:
            return frozenset()
        return frozenset(n for g, ns in self.spec.items() if g in prep.models for n in ns)

    def start(self) -> None:
        """A new agent process: the checkpoint file, the spec's placements, the clean-up."""
        for _ in range(3):
            self.st.restarts += 1
            try:
                prep = DraPreparer(
                    self.nv,
                    CAT,
                    node=NODE,
                    checkpoint=Checkpoint(self.dir / "dra.json"),
                    cdi_dir=self.dir / "cdi",
                )
                if self.spec is not None and self.rng.random() < 0.9:
                    prep.planned = self.planned_names(prep)
                prep.clean_unknown()
            except AgentCrash:
                self.st.crashes += 1
                self.log("  crash while starting")
                continue
            except (NvmlError, ClaimError) as e:  # the pod exits; Kubernetes starts it again
                self.st.failed_starts += 1
                self.log(f"  start failed: {e}")
                self.prep = None
                return
            self.prep = prep
            self.st.starts_with_lost_gpu += bool(prep.pending)
            self.log(f"  agent started (pending {sorted(prep.pending)})")
            return
        self.prep = None

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Call the agent; a crash drops it and starts a new one, then re-raises."""
        try:
            return fn(*args)
        except AgentCrash:
            self.st.crashes += 1
            self.log(f"  crash in {getattr(fn, '__name__', fn)}")
            self.prep = None
            self.start()
            raise

    def stop(self, pid: int) -> None:
        """A process ends; the instance it ran on may be idle now (:meth:`check_in_use`)."""
        for u, (g, gi, _ci) in self.nv.mig_uuids().items():
            if (g, gi) == self.where.get(pid):
                self.freed.add(u)
        self.nv.stop_process(pid)

    def records(self) -> list[ClaimRecord]:
        if self.prep is not None:
            return list(self.prep.checkpoint)
        return list(Checkpoint(self.dir / "dra.json"))

    # -- the kubelet -------------------------------------------------------------------

    def allocated(self) -> list[str]:
        return [d for c in self.claims.values() for d in c.devices]

    def prepare(self, c: Claim) -> None:
        if self.prep is None:
            return  # the plugin is not registered: the kubelet's call fails
        self.st.prepares += 1
        gis = {(g, gi) for g, gi, _ci in self.nv.mig_uuids().values()}
        try:
            got = self.call(self.prep.prepare, ref(c.n), c.allocation())
        except (ClaimError, AgentCrash) as e:
            self.st.prepare_failures += 1
            self.log(f"  prepare {c.n} failed: {str(e)[:160]}")
            return
        have = {d.device: d.uuid for d in got}
        if sorted(have) != sorted(c.devices):
            self.fail(f"claim {c.n} prepared as {have}, allocated {c.devices}")
        if c.prepared is not None and have != c.prepared:
            self.fail(f"claim {c.n} prepared again as {have}, was {c.prepared}")
        self.log(f"  prepared {c.n}")
        if c.prepared is None:  # GPU instances made ahead (planned) that the claim adopted
            now = self.nv.mig_uuids()
            self.st.adopted += sum(now[u][:2] in gis for u in have.values() if u in now)
        c.prepared = have

    def unprepare(self, c: Claim) -> None:
        if self.prep is None:
            return
        self.unprepared.add(c.n)
        busy = bool(c.pids)
        self.st.unprepares += 1
        try:
            self.call(self.prep.unprepare, c.uid)
        except (ClaimError, AgentCrash) as e:
            if busy:
                self.st.unprepare_refused_busy += 1
            else:
                self.st.unprepare_failures += 1
            self.log(f"  unprepare {c.n} failed: {str(e)[:160]}")
            return
        if busy:
            self.fail(f"claim {c.n} unprepared while its processes {c.pids} run")
        self.log(f"  unprepared {c.n}")
        del self.claims[c.n]

    def kubelet_retries(self) -> None:
        if self.kubelet_late:
            return
        for n in sorted(self.stale):
            if self.prep is None:
                return
            try:
                self.call(self.prep.unprepare, ref(n).uid)
            except (ClaimError, AgentCrash) as e:
                self.log(f"  unprepare of stale {n} failed: {str(e)[:160]}")
                continue
            self.stale.discard(n)
        for c in list(self.claims.values()):
            if c.n not in self.claims:
                continue
            if c.releasing:
                if c.pids and self.rng.random() < 0.3:  # the stragglers end
                    for pid in c.pids:
                        self.stop(pid)
                    c.pids.clear()
                self.unprepare(c)
            elif c.prepared is None:
                self.prepare(c)

    def new_claim(self) -> None:
        pool = sorted(self.published) if self.published is not None else self.names
        if self.rng.random() < 0.2:
            pool = self.names  # allocated against an older publication
        if not pool:
            return
        for _ in range(6):
            k = self.rng.choice((1, 1, 1, 2, 2, 3))
            new = self.rng.sample(pool, min(k, len(pool)))
            if fits(self.models, self.targets, self.allocated() + new):
                break
        else:
            return
        self.next += 1
        self.st.claims += 1
        c = Claim(self.next, new)
        self.claims[c.n] = c
        self.log(f"allocate {c.n}: {new}")
        self.prepare(c)

    def stale_claim(self) -> None:
        prepared = [d.device for r in self.records() if r.state == "completed" for d in r.devices]
        if not prepared:
            return
        for _ in range(6):
            if self.rng.random() < 0.5:  # over a prepared device (one of another GPU may follow)
                x = self.targets[self.rng.choice(prepared)]
                new = [self.rng.choice([n for n in self.names if overlap(self.targets[n], x)])]
                if self.rng.random() < 0.3:
                    new.append(self.rng.choice(sorted(set(self.names) - set(new))))
            else:
                new = self.rng.sample(self.names, self.rng.choice((1, 1, 2)))
            if not fits(self.models, self.targets, prepared + new):
                break
        else:
            return
        if self.prep is None:
            return
        self.next += 1
        self.log(f"stale allocation {self.next}: {new}")
        # whatever prepare answers, the kubelet unprepares the claim once its pod is deleted
        self.stale.add(self.next)
        try:
            self.call(
                self.prep.prepare,
                ref(self.next),
                [AllocatedDevice(f"r{i}", NODE, d) for i, d in enumerate(new)],
            )
        except AgentCrash:
            return
        except ClaimError as e:
            self.st.stale_refused += 1
            self.log(f"  refused: {str(e)[:160]}")
            return
        self.fail(f"stale allocation {new} prepared beside the prepared {prepared}")

    def pod_process(self) -> None:
        ready = [c for c in self.claims.values() if c.prepared is not None and not c.releasing]
        if not ready:
            return
        c = self.rng.choice(ready)
        assert c.prepared is not None
        name, uuid = self.rng.choice(sorted(c.prepared.items()))
        t = self.targets[name]
        if t.profile is None:
            pid = self.nv.start_process(t.gpu)
            self.where[pid] = (t.gpu, None)
        else:
            g, gi, ci = self.nv.mig_uuids()[uuid]
            pid = self.nv.start_process(g, gi, ci)
            self.where[pid] = (g, gi)
        c.pids.append(pid)
        self.st.pod_processes += 1
        self.log(f"pod process {pid} of claim {c.n} on {name}")

    def pod_process_ends(self) -> None:
        busy = [c for c in self.claims.values() if c.pids]
        if busy:
            c = self.rng.choice(busy)
            pid = c.pids.pop(self.rng.randrange(len(c.pids)))
            self.stop(pid)
            self.log(f"pod process {pid} of claim {c.n} ends")

    def stray(self) -> None:
        owned = {d.uuid for r in self.records() for d in r.devices}
        held = {uuid for c in self.claims.values() for uuid in (c.prepared or {}).values()}
        choices: list[tuple[int, int | None, int | None]] = []
        for g in range(len(self.models)):
            if self.nv.mig_enabled(g):
                for gi_id, _p, _s, uuids in self.nv.instances(g):
                    if uuids and not set(uuids) & (owned | held):
                        choices.append((g, gi_id, 0))
            elif self.nv.gpu_uuid(g) not in owned | held:
                choices.append((g, None, None))
        if not choices:
            return
        gpu, gi, ci = self.rng.choice(choices)
        pid = self.nv.start_process(gpu, gi, ci)
        self.strays[pid] = self.where[pid] = (gpu, gi)
        self.st.strays += 1
        self.log(f"stray process {pid} on GPU {gpu} GI {gi}")

    def pod_done(self) -> None:
        live = [c for c in self.claims.values() if not c.releasing]
        if not live:
            return
        c = self.rng.choice(live)
        if self.rng.random() < 0.6:  # the containers are gone; else some straggle on
            for pid in c.pids:
                self.stop(pid)
            c.pids.clear()
        c.releasing = True
        self.log(f"pod of claim {c.n} done (pids left {c.pids})")
        self.unprepare(c)

    def new_spec(self) -> None:
        self.st.specs += 1
        if self.rng.random() < 0.05:
            self.spec = None
            self.log("spec: no NodePartitioning")
            return
        spec: dict[int, list[str]] = {}
        for g, model in enumerate(self.models):
            r = self.rng.random()
            mine = [self.targets[d] for d in self.allocated() if self.targets[d].gpu == g]
            if r < 0.2 or any(t.profile is None for t in mine):
                spec[g] = []
                continue
            pinned = frozenset((t.profile.name, t.start) for t in mine if t.profile is not None)
            lays = layouts_with(model, pinned) if r < 0.75 else []
            lay = list(self.rng.choice(lays or layouts(model)))
            if self.rng.random() < 0.3:
                lay = [p for p in lay if self.rng.random() < 0.6]
            spec[g] = [device_name(g, p.profile, p.start) for p in lay]
        self.spec = spec
        self.log(f"spec: {spec}")

    def faults(self) -> list[Any]:
        """Inject 1-3 faults; return those to remove at the end of the step."""
        scoped = []
        for _ in range(self.rng.randint(1, 3)):
            once = self.rng.random() < 0.6
            op = self.rng.choice(MUTATING if self.rng.random() < 0.6 else OPS)
            code = self.rng.choice(CODES)
            if op == "create_gpu_instance" and self.rng.random() < 0.5:
                code = NvmlErrorCode.INSUFFICIENT_RESOURCES
            elif self.rng.random() < 0.05:  # NVML itself down: the round (or the start) fails
                op, code, once = "gpus", NvmlErrorCode.DRIVER_NOT_LOADED, True
            f = self.nv.inject(
                op,
                code,
                times=1 if once else None,
                probability=1.0 if once else self.rng.choice((0.3, 1.0)),
                after=self.rng.random() < 0.35,
            )
            self.log(f"fault {op} {code.name} once={once} p={f.probability} after={f.after}")
            if not once:
                scoped.append(f)
        return scoped

    def lose_gpu(self) -> None:
        g = self.rng.randrange(len(self.models))
        if g in self.lost:
            return
        f = self.nv.inject("*", NvmlErrorCode.GPU_IS_LOST, times=None, gpu=g)
        self.lost[g] = (f, self.rng.randint(1, 4))
        self.st.lost_gpus += 1
        self.log(f"GPU {g} lost")

    def crash_armed(self) -> None:
        op = self.rng.choice((*OPS, "*"))
        self.nv.inject(
            op,
            times=1,
            probability=self.rng.choice((1.0, 0.3)),
            after=self.rng.random() < 0.5,
            error=AgentCrash,
        )
        self.log(f"crash armed on {op}")

    def reboot(self) -> None:
        self.st.reboots += 1
        self.log("reboot")
        self.nv.reboot()
        self.rebooted = True
        self.strays.clear()
        for c in self.claims.values():
            c.pids.clear()
            if c.prepared is not None:
                c.prepared = None  # the kubelet prepares it again
                self.st.reprepared_after_reboot += 1
        self.prep = None
        self.start()
        self.kubelet_late = self.rng.choice((0, 1, 2))  # it retries after the node is back

    def xid(self) -> None:
        if self.prep is None:
            return
        g = self.rng.randrange(len(self.models))
        gis = [gi for gi, *_ in self.nv.instances(g)] if self.nv.mig_enabled(g) else []
        if gis and self.rng.random() < 0.8:
            ev = XidEvent(g, 48, self.rng.choice(gis), 0)
        else:
            ev = XidEvent(g, 79)
        self.st.xids += 1
        self.log(f"XID {ev}")
        with suppress(AgentCrash):
            self.call(self.prep.mark_xids, [ev])

    # -- one shaped round (DraDriver._shaped_round) -----------------------------------

    def round(self) -> None:
        if self.prep is None:
            self.start()
            if self.prep is None:
                return
        prep = self.prep
        self.st.rounds += 1
        try:
            self.call(prep.read_pending)
            unreadable = self.call(prep.unreadable)
            planned_names = self.planned_names(prep)
            planned = {g: list((self.spec or {}).get(g, ())) for g in prep.models}
            allocated = set(self.allocated()) | {
                d.device for r in prep.checkpoint for d in r.devices
            }
            prep.planned = planned_names
            try:
                self.st.idle_destroyed += self.call(
                    prep.destroy_idle, planned_names | allocated, frozenset(unreadable)
                )
            except Exception as e:
                self.log(f"  destroy_idle failed: {e}")
            foreign = self.call(prep.foreign_use, frozenset(unreadable))
            try:
                self.st.planned_created += self.call(
                    prep.create_planned,
                    planned_names,
                    frozenset(allocated),
                    frozenset(unreadable) | whole_gpus(prep.targets, foreign),
                )
            except Exception as e:
                self.log(f"  create_planned failed: {e}")
            want = publish_set(
                planned,
                allocated,
                unreadable.keys(),
                prep.xid_devices() | foreign_devices(prep.targets, foreign),
            )
        except AgentCrash:
            self.st.rounds_failed += 1
            return
        except NvmlError as e:
            self.st.rounds_failed += 1
            self.log(f"  round failed: {e}")
            return
        self.log(f"  round: unreadable {sorted(unreadable)}, foreign {[str(f) for f in foreign]}")
        self.check_published(want, allocated)
        self.published = want

    # -- invariants ----------------------------------------------------------------------

    def in_use(self) -> tuple[set[str], set[str]]:
        """The MIG devices ``completed`` records own, and those processes run on."""
        have = self.nv.mig_uuids()
        owned = {
            d.uuid
            for r in self.records()
            if r.state == "completed"
            for d in r.devices
            if d.profile is not None and d.uuid in have
        }
        busy = {u for u, (g, gi, _ci) in have.items() if self.nv.processes_on(g, gi)}
        return owned, busy

    def check_in_use(self, before: tuple[set[str], set[str]]) -> None:
        if self.rebooted:
            return
        owned, busy = before
        released = {u for n in self.unprepared for u in self.prepared_before.get(n, {}).values()}
        # still in use: what a claim owns that the kubelet did not unprepare (its pod is done),
        # what runs processes but for those whose processes ended in the step
        gone = ((owned - released) | (busy - self.freed)) - set(self.nv.mig_uuids())
        if gone:
            self.fail(f"in-use MIG devices destroyed: {sorted(gone)}")

    def check_prepared(self) -> None:
        have = self.nv.mig_uuids()
        records = {r.uid: r for r in self.records()}
        for c in self.claims.values():
            if c.prepared is None or c.releasing:
                continue
            rec = records.get(c.uid)
            if rec is None or rec.state != "completed":
                self.fail(f"claim {c.n} prepared but its record is {rec}")
            if {d.device: d.uuid for d in rec.devices} != c.prepared:
                self.fail(
                    f"claim {c.n}: record {rec.devices} is not what was prepared {c.prepared}"
                )
            for name, uuid in c.prepared.items():
                t = self.targets[name]
                if t.profile is None:
                    if uuid != self.nv.gpu_uuid(t.gpu) or self.nv.mig_enabled(t.gpu):
                        self.fail(f"claim {c.n}: GPU {t.gpu} held whole has MIG on")
                    continue
                if uuid not in have:
                    self.fail(f"claim {c.n}: its device {name} ({uuid}) is gone")
                g, gi, _ = have[uuid]
                (inst,) = [i for i in self.nv.instances(g) if i[0] == gi]
                if (g, inst[1].name, inst[2]) != (t.gpu, t.profile.name, t.start):
                    self.fail(f"claim {c.n}: {name} is at {inst[1].name}@{inst[2]} on GPU {g}")

    def check_records_disjoint(self) -> None:
        seen: list[tuple[str, DeviceTarget]] = []
        for r in self.records():
            for d in r.devices:
                t = self.targets[d.device]
                for uid, o in seen:
                    if uid != r.uid and overlap(t, o):
                        self.fail(f"records {uid} and {r.uid} overlap on {d.device}")
                seen.append((r.uid, t))

    def check_published(self, want: set[str], allocated: set[str]) -> None:
        whole_held = {
            self.targets[d.device].gpu
            for r in self.records()
            for d in r.devices
            if d.profile is None
        }
        whole: set[int] = set()  # GPUs with MIG off running a stray process
        taken: dict[int, set[int]] = {}  # the memory slots of instances running one
        for g, gi in self.strays.values():
            if g in whole_held:
                continue  # the claim holding the GPU owns its processes
            if gi is None:
                whole.add(g)
                continue
            ((_gi, p, start, _u),) = [i for i in self.nv.instances(g) if i[0] == gi]
            taken.setdefault(g, set()).update(range(start, start + p.memory_slices))
        for name in want - allocated:
            t = self.targets[name]
            s = slots(t)
            if t.gpu in whole or (t.gpu in taken and (s is None or s & taken[t.gpu])):
                self.fail(f"published free device {name} shares a slot with a stray process")
        if taken or whole:
            self.st.stray_instances_withdrawn += 1

    # -- a sequence ----------------------------------------------------------------------

    def step(self) -> None:
        self.st.steps += 1
        scoped: list[Any] = []
        r = self.rng.random()
        if r < 0.20:
            self.new_claim()
        elif r < 0.25:
            self.stale_claim()
        elif r < 0.33:
            self.pod_process()
        elif r < 0.37:
            self.pod_process_ends()
        elif r < 0.45:
            self.stray()
        elif r < 0.50:
            if self.strays:
                pid = self.rng.choice(sorted(self.strays))
                self.stop(pid)
                del self.strays[pid]
                self.log(f"stray {pid} ends")
        elif r < 0.59:
            self.pod_done()
        elif r < 0.65:
            self.new_spec()
        elif r < 0.79:
            scoped = self.faults()
        elif r < 0.82:
            self.lose_gpu()
        elif r < 0.88:
            self.crash_armed()
        elif r < 0.92:
            self.log("agent restart")
            self.prep = None
            self.start()
            if self.rng.random() < 0.5:  # the kubelet restarts too: it prepares every pod's
                self.log("kubelet restart")  # claims again, which must answer the same
                for c in list(self.claims.values()):
                    if not c.releasing:
                        self.st.kubelet_reprepares += c.prepared is not None
                        self.prepare(c)
        elif r < 0.95:
            self.reboot()
        else:
            self.xid()
        if self.rng.random() < 0.5:
            self.kubelet_retries()
            self.round()
        else:
            self.round()
            self.kubelet_retries()
        for f in scoped:
            self.nv.faults.remove(f)
        self.kubelet_late = max(0, self.kubelet_late - 1)
        for g, (f, left) in list(self.lost.items()):
            if left <= 1:
                self.nv.faults.remove(f)
                del self.lost[g]
                self.log(f"GPU {g} reads again")
            else:
                self.lost[g] = (f, left - 1)

    def run(self) -> None:
        self.start()
        if self.rng.random() < 0.8:
            self.new_spec()
        for _ in range(self.rng.randint(6, 16)):
            before = self.in_use()
            self.rebooted = False
            self.unprepared = set()
            self.freed = set()
            self.prepared_before = {c.n: dict(c.prepared or {}) for c in self.claims.values()}
            self.step()
            self.check_in_use(before)
            self.check_prepared()
            self.check_records_disjoint()
        self.settle()

    def settle(self) -> None:
        self.log("-- the faults stop")
        self.nv.clear_faults()
        self.lost.clear()
        for pid in self.strays:
            self.stop(pid)
        self.strays.clear()
        self.kubelet_late = 0
        for c in self.claims.values():
            if c.releasing:
                for pid in c.pids:
                    self.stop(pid)
                c.pids.clear()
        if self.prep is None or self.prep.xid_marks:
            if self.prep is not None:
                self.st.xid_restarts += 1
                self.log("agent restart (XID marks)")
            self.start()
        for _ in range(FINAL_ROUNDS):
            self.kubelet_retries()
            self.round()
        self.check_prepared()
        self.check_records_disjoint()
        if self.stale:
            self.fail(f"stale claims {sorted(self.stale)} could not be unprepared")
        for c in self.claims.values():
            if c.releasing:
                self.fail(f"claim {c.n} could not be unprepared")
            if c.prepared is None:
                self.fail(f"claim {c.n} ({c.devices}) is allocated but not prepared")
            self.st.claims_checked += 1
        assert self.prep is not None
        for g, model in enumerate(self.models):
            mine = [self.targets[d] for d in self.allocated() if self.targets[d].gpu == g]
            if any(t.profile is None for t in mine):
                continue  # held whole (MIG off, checked above)
            planned = [self.targets[n] for n in (self.spec or {}).get(g, ())]
            free = {
                (p, s)
                for p, s, used in reported_layout(
                    model,
                    [(t.profile, t.start) for t in mine],
                    [(t.profile, t.start) for t in planned if t.profile is not None],
                )
                if not used
            }
            want = {(t.profile.name, t.start) for t in mine if t.profile is not None} | free
            have = (
                {(p.name, s) for _gi, p, s, _u in self.nv.instances(g)}
                if self.nv.mig_enabled(g)
                else set()
            )
            bare = (
                [(p.name, s) for _gi, p, s, u in self.nv.instances(g) if not u]
                if self.nv.mig_enabled(g)
                else []
            )
            self.st.planned_checked += len(free)
            if have != want or bare:
                self.fail(
                    f"GPU {g} did not converge: instances {sorted(have)} (without a compute "
                    f"instance: {bare}), want {sorted(want)} (allocated "
                    f"{[(t.profile.name, t.start) for t in mine if t.profile]}, planned free "
                    f"{sorted(free)})"
                )


@contextmanager
def quiet() -> Iterator[None]:
    """The agent logs every fault at WARNING; thousands of them only slow the test down."""
    logger = logging.getLogger("node_agent")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def test_random_fault_sequences_never_destroy_in_use_and_converge() -> None:
    st = Stats()
    t0 = time.perf_counter()
    with quiet(), tempfile.TemporaryDirectory(prefix="gsdraf-") as tmp:
        for seed in range(FIRST_SEED, FIRST_SEED + SEQUENCES):
            st.sequences += 1
            d = Path(tmp) / f"s{seed}"
            seq = Sequence(seed, st, d)
            seq.run()
            st.nvml_calls += seq.nv.calls
            st.faults += seq.nv.faults_raised
    took = time.perf_counter() - t0
    print(
        f"\nDRA agent fault sequences: {st.sequences} sequences, {st.steps} steps, "
        f"{st.rounds} shaped rounds ({st.rounds_failed} failed), {st.specs} specs, "
        f"{st.nvml_calls} NVML calls, {st.faults} NVML faults raised, {st.crashes} agent "
        f"crashes, {st.restarts} agent starts ({st.failed_starts} failed, "
        f"{st.starts_with_lost_gpu} with a GPU unreadable), {st.reboots} reboots, "
        f"{st.lost_gpus} GPUs lost, {st.xids} XIDs ({st.xid_restarts} restarts for them); "
        f"{st.claims} claims allocated, {st.prepares} prepares ({st.prepare_failures} failed, "
        f"{st.reprepared_after_reboot} claims prepared again after a reboot, "
        f"{st.kubelet_reprepares} prepared claims prepared again by a restarted kubelet, "
        f"{st.adopted} planned instances adopted), "
        f"{st.stale_refused} stale allocations refused, {st.unprepares} unprepares "
        f"({st.unprepare_refused_busy} refused while processes ran, {st.unprepare_failures} "
        f"failed otherwise), {st.pod_processes} pod processes, {st.strays} stray processes "
        f"({st.stray_instances_withdrawn} rounds withdrawing around them), {st.idle_destroyed} "
        f"idle instances destroyed, {st.planned_created} planned instances created; converged: "
        f"{st.claims_checked} claims prepared, {st.planned_checked} planned placements made; "
        f"{took:.1f} s"
    )
    assert st.sequences == SEQUENCES
    n = SEQUENCES
    assert st.faults > n and st.crashes > n // 4 and st.reboots > n // 10
    assert st.restarts > n and st.lost_gpus > n // 10 and st.xids > n // 10
    assert st.prepares > n and st.prepare_failures > n // 4 and st.stale_refused > n // 20
    assert st.unprepare_refused_busy > n // 20 and st.strays > n // 4
    assert st.stray_instances_withdrawn > n // 10 and st.rounds > 5 * n and st.specs > n
    assert st.claims_checked > n // 2 and st.planned_checked > n
    assert st.reprepared_after_reboot > n // 20 and st.kubelet_reprepares > n // 20
    assert st.adopted > n // 4


# -- the bugs the sequences found, one reproduction each -------------------------------------


def _preparer(nv: FakeNvml, tmp: Path) -> DraPreparer:
    return DraPreparer(nv, CAT, node=NODE, checkpoint=Checkpoint(tmp / "dra.json"))


def test_a_gpu_whose_processes_cannot_be_read_now_is_taken_as_used_whole(tmp_path: Path) -> None:
    """A read failing in ``foreign_use`` (after the round's ``unreadable``) left the GPU out, so
    the round published the free devices around a process outside any claim (seed 40)."""
    nv = FakeNvml([H100], mig_enabled=True)
    p = H100.profile("2g.20gb")
    gi = nv.create_gpu_instance(0, p.profile_id, 2, p.memory_slices)
    nv.create_compute_instance(0, gi)
    nv.start_process(0, gi, 0)
    prep = _preparer(nv, tmp_path)
    assert [f.device for f in prep.foreign_use()] == [device_name(0, p, 2)]
    nv.inject("running_processes", NvmlErrorCode.UNKNOWN)
    foreign = prep.foreign_use()
    assert whole_gpus(prep.targets, foreign) == {0}
    over = device_name(0, H100.profile("1g.10gb"), 3)
    assert over in foreign_devices(prep.targets, foreign)
    assert over not in publish_set({0: [over]}, set(), (), foreign_devices(prep.targets, foreign))


def test_a_planned_instance_left_without_its_compute_instance_is_completed(
    tmp_path: Path,
) -> None:
    """A planned creation whose compute instance and rollback both failed left a bare GPU
    instance that ``create_planned`` took for "there already" for ever (seed 83)."""
    nv = FakeNvml([H100], mig_enabled=True)
    prep = _preparer(nv, tmp_path)
    p = H100.profile("1g.10gb")
    name = device_name(0, p, 2)
    nv.inject("create_compute_instance", NvmlErrorCode.TIMEOUT)
    nv.inject("destroy_gpu_instance", NvmlErrorCode.IN_USE)
    assert prep.create_planned({name}) == 0
    assert [(q.name, s, u) for _gi, q, s, u in nv.instances(0)] == [("1g.10gb", 2, ())]
    assert prep.destroy_idle({name}) == 0  # planned: kept
    assert prep.create_planned({name}) == 1
    ((_gi, q, s, uuids),) = nv.instances(0)
    assert (q.name, s) == ("1g.10gb", 2) and len(uuids) == 1


def test_after_a_reboot_a_prepared_claims_placement_goes_to_no_other_claim(
    tmp_path: Path,
) -> None:
    """After a reboot a prepared claim's instances are gone until the kubelet prepares it
    again; an allocation the counters refuse beside it was prepared there (the hardware held
    nothing), and the claim could never be prepared again (seed 13)."""
    nv = FakeNvml([H100, H100])
    prep = _preparer(nv, tmp_path)
    big = device_name(0, H100.profile("3g.40gb"), 0)
    me = device_name(1, H100.profile("1g.10gb+me"), 0)
    first = prep.prepare(ref(1), [AllocatedDevice("a", NODE, big), AllocatedDevice("b", NODE, me)])
    nv.reboot()
    prep = _preparer(nv, tmp_path)
    prep.clean_unknown()
    for stale in (
        device_name(0, H100.profile("1g.10gb"), 1),
        device_name(1, H100.profile("1g.10gb+me"), 5),
    ):
        with pytest.raises(ClaimError, match="team/claim-1"):
            prep.prepare(ref(2), [AllocatedDevice("a", NODE, stale)])
        assert prep.checkpoint.get(ref(2).uid) is None and nv.mig_uuids() == {}
    again = prep.prepare(ref(1), [AllocatedDevice("a", NODE, big), AllocatedDevice("b", NODE, me)])
    assert [(d.device, d.start) for d in again] == [(d.device, d.start) for d in first]
    assert {d.uuid for d in again} == set(nv.mig_uuids())
    # the claims it does not conflict with are prepared as before
    prep.prepare(ref(3), [AllocatedDevice("a", NODE, device_name(0, H100.profile("1g.10gb"), 4))])
