"""Randomised fault tests of the node agent's reconciler on the fake NVML.

Each sequence builds a node (1-2 GPUs of catalog models), then runs 5-15 random steps: new
specs (MIG, MPS, hybrid; valid, pinned to what is in use, conflicting, or invalid), pods
allocating and releasing advertised devices (also *during* NVML calls, to race the agent),
processes on devices, NVML faults (once / always / with a probability, before or after the call
takes effect), PodResources failures, MPS daemon start failures, agent crashes at any NVML
call (the agent object is dropped and a new one starts from the hardware and the allocation
ledger it persisted), node reboots (pods, processes, daemons and the ledger gone; Ampere keeps
-- and applies a pending -- MIG mode, Hopper loses it), and the MIG-mode activation path: on
Ampere a mode change is pending until the agent resets the idle GPU with the host driver's
``nvidia-smi`` (the fake NVML emulates the tool; persistence mode may be on, which the reset
procedure turns off around it); a CUDA job may grab a GPU whose change is pending (the reset
waits, naming the job), a reset may fail like any call, and some nodes' agents were not given
``nvidia-smi``, where a needed mode change must end Degraded (``MIGModePending``).

Allocation is modelled as the kubelet does it: ``Allocate`` (the device plugin records the ids
in the agent's :class:`~node_agent.allocations.AllocationLedger`) returns *before* the kubelet
records the allocation, so PodResources shows a device only some ``List`` answers later;
some allocations are abandoned after ``Allocate`` (the pod's admission failed) and never show.
A pod given a device whose ``Allocate`` env names an MPS pipe directory (an MPS slice, or a MIG
instance of a hybrid GPU) is a client of that MPS daemon.  Hybrid specs also put MPS slices
inside instances (keeping the slices pods hold, most of the time, like the planner); a held
slice inside an instance holds that instance too.

Checked all the time, counted, and required to be zero:

* *in-use destroyed*: no device held by a pod ever disappears (the MIG device of an allocated
  UUID is never destroyed; every allocated MPS slice stays in the agent's state);
* *used daemons stopped*: the agent never stops (or restarts for another device) an MPS daemon
  while a pod is its client.

Checked after the faults stop (the kubelet has caught up and the ledger's grace has passed):
every GPU of the spec matches it exactly -- MPS daemons serving their devices with the largest
slice as limits included -- unless the harness's own judgement says it cannot (a used device
in the way, an invalid spec, no ``nvidia-smi``), in which case the status is Degraded naming
that GPU.  The counts are printed.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache

from manual_clock import ManualClock

from contract.nodepartitioning import NodePartitioningSpec, NodePartitioningStatus
from node_agent.allocations import AllocationLedger, LedgerInUse
from node_agent.devices import ENV_MPS_PIPE, AdvertisedDevice, parse_mps_slice_id
from node_agent.mig_activation import MigActivation, mig_activation
from node_agent.mps import FakeSupervisor, MpsDaemonSpec
from node_agent.nvml import NvmlErrorCode
from node_agent.nvml_fake import OPS, FakeNvml
from node_agent.reconciler import Reconciler
from planner.catalog import CatalogError, GpuModel, MigProfile, default_catalog
from planner.geometry import Placement, enumerate_layouts, layout_errors

SEQUENCES = int(os.environ.get("GPUSLICE_FAULT_SEQUENCES", "10000"))
CAT = default_catalog()
MIG_MODELS = [CAT.model(n) for n in ("A100-SXM4-80GB", "H100-80GB", "A30", "A100-SXM4-40GB")]
MPS_ONLY = CAT.model("V100-32GB")
MUTATING = ("set_mig_mode", "reset_gpu", "set_compute_mode", "create_gpu_instance",
            "create_compute_instance", "destroy_compute_instance", "destroy_gpu_instance")  # fmt: skip
CODES = (NvmlErrorCode.UNKNOWN, NvmlErrorCode.TIMEOUT, NvmlErrorCode.IN_USE,
         NvmlErrorCode.INSUFFICIENT_RESOURCES, NvmlErrorCode.GPU_IS_LOST)  # fmt: skip


class AgentCrash(BaseException):
    """The agent process dies (not an Exception: nothing in the agent may swallow it)."""


class Violation(AssertionError):
    pass


@cache
def layouts(
    model: GpuModel,
) -> tuple[list[tuple[Placement, ...]], dict[tuple[str, int], frozenset[int]]]:
    """Every valid layout of ``model``, and per (profile, start) the layouts holding it."""
    lays = list(enumerate_layouts(model))
    holding: dict[tuple[str, int], set[int]] = {}
    for k, lay in enumerate(lays):
        for p in lay:
            holding.setdefault((p.profile.name, p.start), set()).add(k)
    return lays, {key: frozenset(ks) for key, ks in holding.items()}


@cache
def layouts_with(
    model: GpuModel, pinned: frozenset[tuple[str, int]]
) -> list[tuple[Placement, ...]]:
    """The layouts of ``model`` holding every pinned (profile, start)."""
    lays, holding = layouts(model)
    ks: frozenset[int] = frozenset(range(len(lays)))
    for key in pinned:
        ks &= holding.get(key, frozenset())
    return [lays[k] for k in sorted(ks)]


GRACE_S = 60.0
"""The agent's allocation grace period (node_agent.allocations)."""
STEP_S = 7.0
"""Time between two steps of a sequence."""


@dataclass
class Kubelet:
    """Fake kubelet: advertised devices, pods holding some, a late and flaky PodResources."""

    rng: random.Random
    nv: FakeNvml
    ledger: CountingLedger
    advertised: dict[str, AdvertisedDevice] = field(default_factory=dict)
    allocated: dict[str, int | None] = field(default_factory=dict)  # device id -> pid
    hidden: dict[str, int] = field(default_factory=dict)
    """Allocated device -> List answers that will not show it yet."""
    client_of: dict[str, str] = field(default_factory=dict)
    """Allocated device -> key of the MPS daemon whose pipe its Allocate env names."""
    race: float = 0.0
    fail_in_use: float = 0.0
    in_use_failures: int = 0
    delayed: int = 0
    abandoned: int = 0
    mps_clients: int = 0
    hosted_clients: int = 0
    destroyed_in_use: set[str] = field(default_factory=set)

    def set_devices(self, devices: object) -> None:
        assert isinstance(devices, dict)
        self.advertised = {d.id: d for ds in devices.values() for d in ds if d.healthy}

    async def in_use_device_ids(self) -> set[str]:
        if self.fail_in_use and self.rng.random() < self.fail_in_use:
            self.in_use_failures += 1
            raise ConnectionError("PodResources: connection refused (injected)")
        shown = set()
        for dev in self.allocated:
            if self.hidden.get(dev, 0) > 0:
                self.hidden[dev] -= 1
            else:
                shown.add(dev)
        return shown

    def allocate(self) -> None:
        """The kubelet admits a pod: Allocate (the plugin records the id), then the record."""
        free = [i for i in self.advertised if i not in self.allocated]
        if not free:
            return
        dev = self.rng.choice(sorted(free))
        self.ledger.record([dev])  # what the device plugin does before Allocate returns
        if self.rng.random() < 0.08:  # admission fails after Allocate: never recorded
            self.abandoned += 1
            return
        lag = self.rng.choice((0, 0, 1, 1, 2, 3, 5))
        if lag:
            self.hidden[dev] = lag
            self.delayed += 1
        pipe = self.advertised[dev].env.get(ENV_MPS_PIPE)
        if pipe:
            self.client_of[dev] = pipe.rsplit("/", 1)[1]
            self.mps_clients += 1
            sid = parse_mps_slice_id(dev)
            self.hosted_clients += sid is not None and sid.gpu_uuid.startswith("MIG-")
        pid = None
        if self.rng.random() < 0.5:  # the pod's container starts CUDA work
            migs = self.nv.mig_uuids()
            mig = migs.get(dev)
            sid = parse_mps_slice_id(dev)
            if mig is None and sid is not None:
                mig = migs.get(sid.gpu_uuid)  # a slice inside a hybrid instance
            if mig is not None:
                pid = self.nv.start_process(mig[0], mig[1], mig[2])
            else:
                assert sid is not None, dev
                gpu = self.nv.gpu_index_of(sid.gpu_uuid)
                if not self.nv.mig_enabled(gpu):
                    pid = self.nv.start_process(gpu)
        self.allocated[dev] = pid

    def release(self) -> None:
        if self.allocated:
            dev = self.rng.choice(sorted(self.allocated))
            pid = self.allocated.pop(dev)
            self.hidden.pop(dev, None)
            self.client_of.pop(dev, None)
            if pid is not None:
                self.nv.stop_process(pid)

    def caught_up(self) -> None:
        """Every allocation is recorded by now."""
        self.hidden.clear()

    def forget_all(self) -> None:
        """A reboot: no pod holds anything."""
        self.allocated.clear()
        self.hidden.clear()
        self.client_of.clear()
        self.advertised = {}

    def clients(self, key: str) -> list[str]:
        return [dev for dev, k in self.client_of.items() if k == key]

    def hook(self, op: str, args: tuple[int, ...]) -> None:
        if op == "destroy_compute_instance":
            gpu, gi, ci = args
            uuid = self.nv.mig_uuids_of(gpu).get((gi, ci))
            if uuid in self.allocated:
                self.destroyed_in_use.add(uuid)
            for dev in self.allocated:  # a held slice inside the destroyed instance
                sid = parse_mps_slice_id(dev)
                if uuid is not None and sid is not None and sid.gpu_uuid == uuid:
                    self.destroyed_in_use.add(dev)
        if self.race and self.rng.random() < self.race:
            self.allocate()

    def check_mig(self) -> None:
        uuids = self.nv.mig_uuids()
        for dev in self.allocated:
            sid = parse_mps_slice_id(dev)
            if sid is not None and sid.gpu_uuid.startswith("MIG-"):
                if sid.gpu_uuid not in uuids:  # its hybrid instance is gone
                    self.destroyed_in_use.add(dev)
            elif sid is None and dev.startswith("MIG-") and dev not in uuids:
                self.destroyed_in_use.add(dev)

    def hosted_used(self, uuids: Iterable[str]) -> Counter[tuple[int, int]]:
        """(memory, thread %) of the held slices inside the instance with one of ``uuids``."""
        inside = set(uuids)
        out: Counter[tuple[int, int]] = Counter()
        for dev in self.allocated:
            sid = parse_mps_slice_id(dev)
            if sid is not None and sid.gpu_uuid in inside:
                out[(sid.memory_mib, sid.thread_percentage)] += 1
        return out


class CountingLedger(AllocationLedger):
    """The agent's ledger, counting the answers in which it alone protected a held device."""

    def __init__(self, st: Stats, grace: float, clock: ManualClock) -> None:
        super().__init__(grace, clock=clock)
        self.st = st
        self.kube: Kubelet | None = None

    def held(self, visible: Iterable[str]) -> set[str]:
        out = super().held(visible)
        if self.kube is not None and out & self.kube.allocated.keys():
            self.st.held_by_ledger_only += 1
        return out


@dataclass
class WatchedSupervisor(FakeSupervisor):
    """The fake MPS supervisor, counting every stop or restart of a daemon with clients."""

    kube: Kubelet | None = None
    used_stopped: list[str] = field(default_factory=list)

    def _check(self, key: str, what: str) -> None:
        if self.kube is not None and key in self.daemons and self.kube.clients(key):
            self.used_stopped.append(f"{what} {key} serving {self.kube.clients(key)}")

    def stop(self, key: str) -> None:
        self._check(key, "stopped")
        super().stop(key)

    def ensure(self, spec: MpsDaemonSpec) -> None:
        old = self.daemons.get(spec.key)
        if old is not None and old.device_uuid != spec.device_uuid:
            self._check(spec.key, "restarted")
        super().ensure(spec)


@dataclass
class Stats:
    sequences: int = 0
    steps: int = 0
    passes: int = 0
    operations: int = 0
    nvml_calls: int = 0
    faults: int = 0
    in_use_failures: int = 0
    crashes: int = 0
    converged: int = 0
    degraded: int = 0
    gpus_checked: int = 0
    reboots: int = 0
    resets: int = 0
    pending_degraded: int = 0
    allocations_delayed: int = 0
    allocations_abandoned: int = 0
    held_by_ledger_only: int = 0
    """In-use answers in which the ledger alone protected a device a pod held."""
    mps_clients: int = 0
    """Allocations that made a pod a client of an MPS daemon."""
    hosted_clients: int = 0
    """Of those, allocations of an MPS slice inside a hybrid MIG instance."""
    in_use_destroyed: int = 0
    used_daemons_stopped: int = 0
    violations: list[str] = field(default_factory=list)


def used_placements(nv: FakeNvml, kube: Kubelet, gpu: int) -> set[tuple[str, int]]:
    """(profile, start) of the instances on ``gpu`` that a pod holds or a process runs on."""
    return {
        (prof.name, start)
        for gi, prof, start, uuids in nv.instances(gpu)
        if nv.processes_on(gpu, gi)
        or any(u in kube.allocated for u in uuids)
        or kube.hosted_used(uuids)
    }


def hosted_now(
    nv: FakeNvml, kube: Kubelet, gpu: int
) -> dict[tuple[str, int], list[tuple[int, int]]]:
    """(profile, start) -> the held slices inside that instance."""
    return {
        (prof.name, start): list(kube.hosted_used(uuids).elements())
        for _gi, prof, start, uuids in nv.instances(gpu)
        if kube.hosted_used(uuids)
    }


def whole_used(nv: FakeNvml, kube: Kubelet, gpu: int) -> set[tuple[str, int]]:
    """(profile, start) of the instances a pod holds as a whole MIG device."""
    return {
        (prof.name, start)
        for _gi, prof, start, uuids in nv.instances(gpu)
        if any(u in kube.allocated for u in uuids)
    }


def used_slices(nv: FakeNvml, kube: Kubelet, gpu: int) -> Counter[tuple[int, int]]:
    gpu_uuid = nv.gpu_uuid(gpu)
    out: Counter[tuple[int, int]] = Counter()
    for dev in kube.allocated:
        sid = parse_mps_slice_id(dev)
        if sid is not None and sid.gpu_uuid == gpu_uuid:
            out[(sid.memory_mib, sid.thread_percentage)] += 1
    return out


def random_spec(
    rng: random.Random, nv: FakeNvml, kube: Kubelet, n_gpus: int
) -> NodePartitioningSpec:
    mode = rng.choice(("mig", "mig", "mig", "mig", "mps", "hybrid"))
    gpus: list[dict[str, object]] = []
    for i in sorted(rng.sample(range(n_gpus), rng.randint(1, n_gpus))):
        model = nv.model_of(i)
        if mode == "mps" or not model.mig_capable:
            gpus.append({"index": i, "mps": random_mps(rng, model, nv, kube, i)})
            continue
        r = rng.random()
        if r < 0.05:  # invalid: a start the profile does not allow, or an unknown profile
            prof = rng.choice(model.profiles)
            bad = [s for s in range(model.memory_slots) if s not in prof.starts]
            mig = [{"profile": prof.name if bad else "9g.999gb", "start": bad[0] if bad else 0}]
        else:
            # like the planner: keep what is in use (most of the time), fill the rest
            pinned = frozenset(used_placements(nv, kube, i)) if r < 0.92 else frozenset()
            choices = layouts_with(model, pinned)
            lay = rng.choice(choices) if choices else ()
            mig = [{"profile": p.profile.name, "start": p.start} for p in lay]
            if mode == "hybrid":
                held = hosted_now(nv, kube, i)
                whole = whole_used(nv, kube, i)
                for m in mig:
                    key = (str(m["profile"]), int(str(m["start"])))
                    if key in whole or rng.random() < 0.3:
                        continue  # stays a whole MIG device
                    m["mps"] = random_hosted(rng, model.profile(key[0]), held.get(key, []))
            rng.shuffle(mig)
        gpus.append({"index": i, "mig": mig})
    if all("mps" in g for g in gpus):
        mode = "mps"
    return NodePartitioningSpec.model_validate(
        {"planId": f"p{rng.randrange(1000)}", "mode": mode, "gpus": gpus}
    )


def random_hosted(
    rng: random.Random, prof: MigProfile, held: list[tuple[int, int]]
) -> list[dict[str, int]]:
    """MPS slices for an instance of ``prof``: its held ones (most of the time), then more."""
    sizes = list(held) if rng.random() < 0.85 else []
    budget = prof.memory_mib - 512 - sum(m for m, _ in sizes)
    for _ in range(rng.randint(0 if sizes else 1, 3)):
        gb = rng.choice((1, 2, 4, 8))
        if gb * 1024 <= budget:
            budget -= gb * 1024
            sizes.append((gb * 1024, max(1, min(100, gb * 100 * 1024 // prof.memory_mib))))
    return [{"memoryMiB": m, "activeThreadPercentage": p} for m, p in sizes]


def random_mps(
    rng: random.Random, model: GpuModel, nv: FakeNvml, kube: Kubelet, i: int
) -> list[dict[str, int]]:
    sizes = list(used_slices(nv, kube, i).elements()) if rng.random() < 0.8 else []
    budget = model.memory_mib - 512 - sum(m for m, _ in sizes)
    for _ in range(rng.randint(0, 4)):
        gb = rng.choice((4, 8, 10, 16, 20))
        if gb * 1024 <= budget:
            budget -= gb * 1024
            sizes.append((gb * 1024, max(1, min(100, gb * 100 * 1024 // model.memory_mib))))
    if rng.random() < 0.03:
        sizes.append((model.memory_mib * 2, 100))  # invalid: more memory than the GPU has
    return [{"memoryMiB": m, "activeThreadPercentage": p} for m, p in sizes]


def expected_block(
    nv: FakeNvml, kube: Kubelet, spec: NodePartitioningSpec, i: int, can_reset: bool = True
) -> str:
    """The harness's own judgement of why GPU ``i`` cannot reach its spec ("" if it can)."""
    why = _expected_block(nv, kube, spec, i)
    model = nv.model_of(i)
    if why or can_reset or mig_activation(model) is not MigActivation.RESET:
        return why
    want_mig = spec.mode != "mps"
    return "MIG mode change pending, no reset" if nv.mig_enabled(i) != want_mig else ""


def _expected_block(nv: FakeNvml, kube: Kubelet, spec: NodePartitioningSpec, i: int) -> str:
    d = next(g for g in spec.gpus if g.index == i)
    model = nv.model_of(i)
    if spec.mode == "mps":
        if d.mig or sum(s.memoryMiB for s in d.mps) > model.memory_mib:
            return "invalid MPS spec"
        if nv.mig_enabled(i):
            return "MIG instance in use" if used_placements(nv, kube, i) else ""
        extra = used_slices(nv, kube, i) - Counter(
            (s.memoryMiB, s.activeThreadPercentage) for s in d.mps
        )
        return "MPS slice in use not in spec" if extra else ""
    if not model.mig_capable or d.mps:
        return "MIG impossible / MPS in MIG mode"
    try:
        target = [Placement(x.start, model.profile(x.profile)) for x in d.mig]
    except CatalogError:
        return "unknown profile"
    if layout_errors(model, target):
        return "invalid layout"
    if not nv.mig_enabled(i):
        return "GPU busy" if used_slices(nv, kube, i) or nv.processes_on(i) else ""
    want = {(p.profile.name, p.start) for p in target}
    if used_placements(nv, kube, i) - want:
        return "used instance not in spec"
    wanted_slices = {
        (model.profile(x.profile).name, x.start): Counter(
            (s.memoryMiB, s.activeThreadPercentage) for s in x.mps
        )
        for x in d.mig
    }
    for key, held in hosted_now(nv, kube, i).items():
        if Counter(held) - wanted_slices.get(key, Counter()):
            return "held slice inside an instance not in spec"
    for key in whole_used(nv, kube, i):
        if wanted_slices.get(key):
            return "whole-used instance asked to host slices"
    return ""


def gpu_converged(
    nv: FakeNvml,
    sup: FakeSupervisor,
    status: NodePartitioningStatus,
    spec: NodePartitioningSpec,
    i: int,
) -> bool:
    d = next(g for g in spec.gpus if g.index == i)
    model = nv.model_of(i)
    if model.mig_capable and nv.mig_pending(i):
        return False
    if spec.mode == "mps":
        if model.mig_capable and nv.mig_enabled(i):
            return False
        actual = next(g for g in status.gpus if g.index == i)
        have = Counter((s.memoryMiB, s.activeThreadPercentage) for s in actual.mps)
        if have != Counter((s.memoryMiB, s.activeThreadPercentage) for s in d.mps):
            return False
        if not d.mps:
            return True
        daemon = sup.daemons.get(f"gpu{i}")
        return (
            daemon is not None
            and daemon.device_uuid == nv.gpu_uuid(i)
            and daemon.default_pinned_mem_limit_mib == max(s.memoryMiB for s in d.mps)
            and daemon.default_thread_percentage == max(s.activeThreadPercentage for s in d.mps)
        )
    if not nv.mig_enabled(i):
        return False
    have_mig = sorted((p.name, s, ci) for p, s, ci in nv.layout(i))
    want = sorted((model.profile(x.profile).name, x.start, True) for x in d.mig)
    actual = next(g for g in status.gpus if g.index == i)
    have_hosted = {
        m.start: sorted((s.memoryMiB, s.activeThreadPercentage) for s in m.mps)
        for m in actual.mig
        if m.mps
    }
    want_hosted = {
        x.start: sorted((s.memoryMiB, s.activeThreadPercentage) for s in x.mps)
        for x in d.mig
        if x.mps
    }
    if have_hosted != want_hosted:
        return False
    if spec.mode == "hybrid":
        for _gi, _, start, uuids in nv.instances(i):
            daemon = sup.daemons.get(f"gpu{i}-mig{start}")
            if daemon is None or (daemon.device_uuid,) != uuids:  # serves this very instance
                return False
            hosted = want_hosted.get(start)
            if hosted and (
                daemon.default_pinned_mem_limit_mib != max(m for m, _ in hosted)
                or daemon.default_thread_percentage != max(p for _, p in hosted)
            ):
                return False
    return have_mig == want


async def run_sequence(seed: int, st: Stats) -> None:
    rng = random.Random(seed)
    n_gpus = rng.choice((1, 1, 2))
    models = [rng.choice(MIG_MODELS) if rng.random() < 0.9 else MPS_ONLY for _ in range(n_gpus)]
    nv = FakeNvml(models, mig_enabled=rng.random() < 0.5, rng=random.Random(~seed))
    for i in range(n_gpus):
        nv.set_persistence_mode(i, rng.random() < 0.5)  # as nvidia-persistenced left it
    clock = ManualClock(0.0)
    kube = Kubelet(rng, nv, CountingLedger(st, GRACE_S, clock=clock))
    kube.ledger.kube = kube
    nv.hooks.append(kube.hook)

    def count_resets(op: str, args: tuple[int, ...]) -> None:
        st.resets += op == "reset_gpu"

    nv.hooks.append(count_resets)
    can_reset = rng.random() < 0.85  # else the agent was not given nvidia-smi: no reset
    nv.tool_present = can_reset
    sup = WatchedSupervisor(nvml=nv, kube=kube)  # MPS daemons start only in EXCLUSIVE_PROCESS
    slices_lost: set[str] = set()

    def new_agent() -> Reconciler:
        in_use = LedgerInUse(kube, kube.ledger)  # the ledger outlives a crash (its file)
        return Reconciler(nv, in_use, sup, CAT, publish=kube.set_devices)

    agent = new_agent()
    spec = random_spec(rng, nv, kube, n_gpus)
    gen = 1
    status: NodePartitioningStatus | None = None
    stray: list[int] = []
    jobs: list[int] = []  # whole-GPU CUDA jobs on a GPU whose MIG-mode change is pending

    async def one_pass() -> bool:
        nonlocal agent, status
        st.passes += 1
        try:
            res = await agent.reconcile(spec, gen, previous=status, now="t")
        except AgentCrash:
            st.crashes += 1
            kube.advertised = {}  # the device plugin died with the agent
            agent = new_agent()
            kube.check_mig()
            return False
        st.operations += res.operations
        kube.check_mig()
        if res.fresh:
            kept = {d.id for ds in res.devices.values() for d in ds}
            slices = {x for x in kube.allocated if parse_mps_slice_id(x) is not None}
            slices_lost.update(slices - kept)
        status = res.status
        return res.settled

    for _ in range(rng.randint(5, 15)):
        st.steps += 1
        scoped = []
        r = rng.random()
        if r < 0.25:
            spec = random_spec(rng, nv, kube, n_gpus)
            gen += 1
        elif r < 0.42:
            for _ in range(rng.randint(1, 3)):
                kube.allocate()
        elif r < 0.52:
            for _ in range(rng.randint(1, 2)):
                kube.release()
        elif r < 0.70:
            for _ in range(rng.randint(1, 3)):
                once = rng.random() < 0.6
                f = nv.inject(
                    rng.choice(MUTATING if rng.random() < 0.7 else OPS),
                    rng.choice(CODES),
                    times=1 if once else None,
                    probability=1.0 if once else rng.choice((0.3, 1.0)),
                    after=rng.random() < 0.4,
                )
                if not once:
                    scoped.append(f)
        elif r < 0.80:
            nv.inject(
                rng.choice((*OPS, "*")),
                times=1,
                probability=rng.choice((1.0, 0.3)),
                after=rng.random() < 0.5,
                error=AgentCrash,
            )
        elif r < 0.85:
            mig = [
                (g, gi, ci) for u, (g, gi, ci) in nv.mig_uuids().items() if u not in kube.allocated
            ]
            pending = [g for g in range(n_gpus) if nv.mig_pending(g) and not nv.mig_enabled(g)]
            if pending and rng.random() < 0.5:
                jobs.append(nv.start_process(rng.choice(pending)))
            elif mig:
                stray.append(nv.start_process(*rng.choice(sorted(mig))))
        elif r < 0.90 and stray:
            nv.stop_process(stray.pop(rng.randrange(len(stray))))
        elif r < 0.95:
            kube.fail_in_use = rng.choice((0.3, 1.0))
        elif r < 0.98:
            sup.fail_next = 1
        else:  # the node reboots: pods, processes, daemons, /run and the agent start over
            st.reboots += 1
            nv.reboot()
            kube.forget_all()
            kube.ledger = CountingLedger(st, GRACE_S, clock=clock)
            kube.ledger.kube = kube
            stray.clear()
            jobs.clear()
            for key in sup.running():
                sup.kill(key)
            agent = new_agent()
        kube.race = 0.05
        await one_pass()
        for f in scoped:
            nv.faults.remove(f)
        kube.fail_in_use = 0.0
        clock.now += STEP_S

    # the faults stop (and the CUDA jobs end); the kubelet has recorded every allocation and
    # the grace of the abandoned ones is over; the agent must settle
    nv.clear_faults()
    kube.caught_up()
    clock.now += GRACE_S
    for pid in jobs:
        nv.stop_process(pid)
    kube.race = 0.0
    kube.fail_in_use = 0.0
    sup.fail_next = 0
    settled = False
    for _ in range(4):
        if await one_pass():
            settled = True
            break
    assert settled and status is not None, f"seed {seed}: did not settle: {status}"
    degraded = next(c for c in status.conditions if c.type == "Degraded")
    for d in spec.gpus:
        st.gpus_checked += 1
        why = expected_block(nv, kube, spec, d.index, can_reset)
        if why:
            st.degraded += 1
            st.pending_degraded += why.startswith("MIG mode change pending")
            assert degraded.status == "True" and f"GPU {d.index}:" in degraded.message, (
                f"seed {seed}: GPU {d.index} cannot be applied ({why}) but status says {status.conditions}"
            )
        else:
            st.converged += 1
            assert gpu_converged(nv, sup, status, spec, d.index), (
                f"seed {seed}: GPU {d.index} did not converge; spec {spec}; status {status}; "
                f"hardware {nv.layout(d.index)}"
            )
            assert f"GPU {d.index}:" not in degraded.message, (seed, degraded)
    st.nvml_calls += nv.calls
    st.faults += nv.faults_raised
    st.in_use_failures += kube.in_use_failures
    st.allocations_delayed += kube.delayed
    st.allocations_abandoned += kube.abandoned
    st.mps_clients += kube.mps_clients
    st.hosted_clients += kube.hosted_clients
    st.in_use_destroyed += len(kube.destroyed_in_use) + len(slices_lost)
    st.used_daemons_stopped += len(sup.used_stopped)
    if kube.destroyed_in_use or slices_lost or sup.used_stopped:
        st.violations.append(
            f"seed {seed}: destroyed {sorted(kube.destroyed_in_use | slices_lost)}, "
            f"daemons {sup.used_stopped}"
        )


async def test_random_fault_sequences_never_destroy_in_use_and_converge() -> None:
    st = Stats()
    t0 = time.perf_counter()

    async def main() -> None:
        for seed in range(SEQUENCES):
            st.sequences += 1
            await run_sequence(seed, st)

    await main()
    took = time.perf_counter() - t0
    print(
        f"\nagent fault sequences: {st.sequences} sequences, {st.steps} steps, {st.passes} passes, "
        f"{st.operations} NVML mutations, {st.nvml_calls} NVML calls, {st.faults} NVML faults "
        f"injected, {st.in_use_failures} PodResources failures, {st.crashes} agent crashes; "
        f"{st.reboots} reboots, {st.resets} GPU resets tried; "
        f"allocations: {st.allocations_delayed} seen late by PodResources, "
        f"{st.allocations_abandoned} abandoned after Allocate, {st.held_by_ledger_only} in-use "
        f"answers where only the ledger held a pod's device, {st.mps_clients} pods made MPS "
        f"clients ({st.hosted_clients} of a slice inside a hybrid instance); {st.gpus_checked} GPUs checked: {st.converged} converged, {st.degraded} "
        f"degraded (justified; {st.pending_degraded} with a MIG-mode change pending); "
        f"{st.in_use_destroyed} in-use devices destroyed, {st.used_daemons_stopped} used MPS "
        f"daemons stopped; {took:.1f} s"
    )
    assert st.sequences == SEQUENCES
    assert st.in_use_destroyed == 0 and st.used_daemons_stopped == 0, st.violations[:5]
    # the mix really exercised what it claims to (scaled to the number of sequences)
    n = SEQUENCES
    assert st.crashes > n // 4 and st.faults > n and st.in_use_failures > n // 4
    assert st.converged > n // 2 and st.degraded > n // 10
    assert st.reboots > n // 10 and st.resets > n // 4 and st.pending_degraded > n // 100
    assert st.allocations_delayed > n // 2 and st.held_by_ledger_only > n // 10
    assert st.allocations_abandoned > n // 20 and st.mps_clients > n // 10
    assert st.hosted_clients > n // 50
