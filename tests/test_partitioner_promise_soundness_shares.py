"""Randomized property test: promises stay sound on MPS and hybrid nodes too.

The same properties as :mod:`test_partitioner_promise_soundness` (read its docstring: 1 no
over-promise, 2 no promise of an unusable device, 3 restart, 4 determinism), checked the same
way (its step core: :func:`~test_partitioner_promise_soundness.decide_step` and the helpers
beside it), after every step, on random small clusters whose nodes are MIG, **MPS**
(per-GPU MPS slices advertised as ``nvidia.com/gpu-<N>gb``) or **hybrid** (MPS slices
inside MIG instances, the instance then advertised only through its slices), mixed.  What
is modelled as production does it:

* **The agent's status** (:mod:`node_agent.status`): an MPS GPU lists ``mps`` slices
  (memory, thread %, the slice id :func:`node_agent.devices.mps_slice_id`, ``used``); a
  hybrid instance lists the slices it hosts, and is itself ``used`` when a slice is or
  processes run on it, and ``foreign`` when processes run on it and no pod holds a slice.
  ``used`` flags lag the pods as in the MIG test.  An XID (:mod:`node_agent.xid`) marks a MIG
  instance (a hybrid host: the instance and every slice it hosts) or, not MIG-scoped (every
  XID of an MPS GPU), the whole GPU and each of its devices; the status then reports
  ``Degraded`` (``GpuXid``) whatever the spec, as :func:`node_agent.xid.add_xid_blocks` does.
* **The agent's apply** (:func:`node_agent.gpu_plan.plan_gpu`): all or nothing per GPU; an
  instance or slice in use (a pod, processes, a lagging ``used`` flag) or unhealthy must be in
  the spec exactly, else the node reports ``Degraded``; an instance in use as a whole cannot
  become a host; slice tables are rebuilt by the agent's own
  :func:`~node_agent.gpu_plan.diff_slices` (used slices claim their twin, new slices the
  lowest free slot numbers).
* **The kubelet** lists the healthy devices (the hosted slices of a marked host are marked
  too), and allocates through the agent's own
  :func:`~node_agent.deviceplugin.preferred_allocation` (grouped by physical GPU; it knows no
  expected GPU and no ``foreign`` flag); the agent's ``Allocate`` refuses MPS slices of two
  MPS daemons in one container (:func:`node_agent.devices.container_env`: an MPS GPU's, or a
  hybrid instance's), which the kubelet reports as ``UnexpectedAdmissionError`` (the pod
  fails; the partitioner notices it).

A slice hosted by an instance the agent would report ``foreign`` (processes of no pod on it,
no pod holding one of its slices) is as unusable as a ``foreign`` MIG instance: a pod given it
shares the instance with processes gpuslice knows nothing of.  Once a pod holds one of its
slices the agent cannot tell the processes apart (:func:`node_agent.status.actual_gpus`), so
the ground truth here calls its slices usable again.

Property 2 adds, for MPS resources, that a promise names **one slice** (a container takes
its MPS slices from one daemon, :func:`node_agent.devices.container_env`, so gpuslice serves
an MPS pod one slice, :func:`planner.demand.one_mps_slice`), and that a released pod whose
promise holds finds a healthy free slice of its size.  Property 5: a pod asking for more than
one MPS slice (two of one size, or one each of two sizes) never carries a reservation, by the
running controller or a restarted one, and the partitioner rejects it the first step it reads
it (``cannot place`` with the rule's text, :func:`~planner.demand.one_mps_slice`, in an
``Unplaceable`` event or in the message of the gate it gives back).

Found before and no longer exempted: multi-slice MPS pods split over several daemons, which
``Allocate`` refused (now never reserved, property 5; no refusal happens, asserted in
:func:`scheduler_binds`), and such a refusal making a restarted controller cool the node
down again (fixed: the cooldown is read from the refused pod,
tests/test_partitioner_rejection_restart.py).
Also found and fixed: a plan added a new slice to a hybrid host the agent reports ``foreign``
(seed 30002093: the planners' hybrid hosts ignored the host's own flags; such a host is now
sealed, :mod:`planner.hybrid`; test_no_plan_adds_a_slice_to_a_hybrid_host_the_agent_reports_foreign).

Generator: as in the MIG test, plus per node a kind (MIG 40 %, MPS 30 %, hybrid 30 %).  MPS
GPUs get random slices of 5, 10, 20 or 40 GiB (thread % as the planner sets them) within the
GPU's memory less the MPS server reserve; hybrid GPUs a valid MIG layout whose instances host
such slices with a probability of one half.  Pods ask for a MIG profile (1-2 units) or an MPS
size (one slice; one in five asks for two slices, of one size or of two, and must be
rejected).  ``GPUSLICE_SHARES_CLUSTERS`` (default 150), ``GPUSLICE_SHARES_BASE`` and
``GPUSLICE_SHARES_SEED`` (one cluster, ``-s`` prints the counts) as in the MIG test.
"""

from __future__ import annotations

import copy
import itertools
import os
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import test_partitioner_promise_soundness as base
from test_partitioner_promise_soundness import (
    CAT,
    LAYOUTS,
    PRODUCTS,
    T0,
    Counts,
    Inst,
    Running,
    admitted,
    assert_exercised,
    check_no_overpromise,
    check_restart_keeps,
    counted,
    decide_step,
    describe,
    gated_now,
    heal,
    held_units,
    holders,
    mark_broken,
    mark_health_broken,
    promise,
    promise_capacity,
    reservation_of,
    run_seeds,
    step_times,
    took_promised,
    usable_free,
    waiting,
)
from test_partitioner_promises import SEVEN_G, Cluster, gated, reservation, running
from test_partitioner_snapshot import A100, node
from test_partitioner_snapshot import np as np_obj

from contract.nodepartitioning import NodePartitioning
from node_agent.deviceplugin import preferred_allocation
from node_agent.devices import mps_slice_id
from node_agent.gpu_plan import MpsSlot, diff_slices
from partitioner.actions import EmitEvent, PatchPod, WriteSpec
from partitioner.decide import Decision, is_busy
from partitioner.reservations import State
from planner.catalog import GpuModel
from planner.demand import one_mps_slice
from planner.hybrid import instance_usable_mib
from planner.mps import thread_percentage
from planner.settings import PlannerSettings
from planner.snapshot import mps_gb_of, mps_resource

CLUSTERS = int(os.environ.get("GPUSLICE_SHARES_CLUSTERS", "150"))
ONLY_SEED = os.environ.get("GPUSLICE_SHARES_SEED")
BASE_SEED = int(os.environ.get("GPUSLICE_SHARES_BASE", "20271201"))
SETTINGS = PlannerSettings()
RESERVE = SETTINGS.mps_reserve_mib
GIB = 1024
SIZES = (5, 10, 10, 20, 40)
"""Slice sizes (GiB) of generated layouts (10 GiB twice as likely)."""
MPS_A100 = {"gpuslice.io/partitioning": "mps", **A100}
MPS_RESOURCES = tuple(mps_resource(gb) for gb in sorted(set(SIZES)))
MULTI_SLICE = 0.2
"""Share of generated MPS pods asking for two slices (the rest ask for one)."""


# --------------------------------------------------------------------------- the world


@dataclass
class Slice(Inst):
    """An MPS slice (``start`` is its slot): of a GPU, or hosted by :attr:`host`."""

    memory: int = 0
    pct: int = 0
    host: MInst | None = field(default=None, repr=False, compare=False)

    def usable(self, gpu_sick: bool) -> bool:
        h = self.host
        if h is not None and (h.unhealthy or h.shows_foreign()):
            return False
        return super().usable(gpu_sick)


@dataclass
class MInst(Inst):
    """A MIG instance; on a hybrid GPU it may host :attr:`slices` (then it is no device)."""

    slices: list[Slice] = field(default_factory=list)

    def shows_foreign(self) -> bool:
        """The agent reports it ``foreign`` (processes, no pod holds it or a slice of it)."""
        return self.foreign and self.pod is None and not any(s.pod for s in self.slices)


@dataclass
class SGpu:
    index: int
    mig: list[MInst] = field(default_factory=list)
    mps: list[Slice] = field(default_factory=list)
    unhealthy: bool = False

    @property
    def insts(self) -> list[Inst]:
        """The devices the agent advertises (what the MIG test's helpers walk)."""
        out: list[Inst] = []
        for m in self.mig:
            if m.slices:
                out.extend(m.slices)
            else:
                out.append(m)
        out.extend(self.mps)
        return out


@dataclass
class SNode:
    name: str
    model: GpuModel
    gpus: list[SGpu]
    kind: str
    never_applies: bool = False
    refused: bool = False
    """The agent refused the spec it last observed (Degraded, InUse)."""


def usable_mib(model: GpuModel) -> int:
    return model.memory_mib - RESERVE


def new_slice(gb: int, usable: int, slot: int, host: MInst | None) -> Slice:
    mib = gb * GIB
    pct = thread_percentage(mib, usable, SETTINGS.mps_thread_policy)
    return Slice("", slot, mps_resource(gb), memory=mib, pct=pct, host=host)


def random_slices(rng: random.Random, usable: int, host: MInst | None) -> list[Slice]:
    out: list[Slice] = []
    room = usable
    while rng.random() < 0.75:
        fits = [gb for gb in SIZES if gb * GIB <= room]
        if not fits:
            break
        gb = rng.choice(fits)
        out.append(new_slice(gb, usable, len(out), host))
        room -= gb * GIB
    return out


class World(base.World):
    """The MIG test's world with MPS and hybrid nodes (their status, allocatable, conditions)."""

    nodes: dict[str, SNode]  # type: ignore[assignment]
    multi_slice: set[str]
    """Keys of the pods asking for more than one MPS slice (never to be reserved)."""

    def gated_pod(self, now: float) -> None:
        """As the MIG test's, but an MPS pod asks for one slice, or (:data:`MULTI_SLICE`)
        for two: two of its size, or one of its size and one of another."""
        rng = self.rng
        res = rng.choice(self.resources())
        roll = rng.random()
        if mps_gb_of(res) is None:
            units = {res: 2 if roll < 0.2 else 1}
        elif roll < MULTI_SLICE / 2:
            units = {res: 2}
        elif roll < MULTI_SLICE:
            units = {res: 1, rng.choice([r for r in MPS_RESOURCES if r != res]): 1}
        else:
            units = {res: 1}
        created = now - rng.choice((0, 0, 5, 100, 700, 2000))
        priority = rng.choice((0, 0, 0, 0, 100, 1000))
        pod = self.new_pod(self.name("g"), units, created, priority)
        if sum(k for r, k in units.items() if mps_gb_of(r) is not None) > 1:
            self.multi_slice.add(f"ns/{pod['metadata']['name']}")
            self.counts.add("mps_multi_slice_pods")

    def slice_id(self, n: SNode, g: SGpu, s: Slice) -> str:
        owner = self.inst_id(n, g, s.host) if s.host is not None else f"GPU-{n.name}-{g.index}"
        return mps_slice_id(owner, s.start, s.memory, s.pct)

    @staticmethod
    def inst_id(n: SNode, g: SGpu, m: MInst) -> str:
        return f"MIG-{n.name}-{g.index}-{m.start}"

    def status_gpus(self, n: SNode) -> list[dict[str, Any]]:  # type: ignore[override]
        out = []
        for g in n.gpus:
            mig = []
            for m in sorted(g.mig, key=lambda x: x.start):
                used_slices = any(s.shown_used for s in m.slices)
                busy = m.foreign  # processes of no pod (an MPS server is not counted)
                e: dict[str, Any] = {
                    "profile": m.profile,
                    "start": m.start,
                    "deviceId": self.inst_id(n, g, m),
                    "used": m.shown_used or busy or used_slices,
                }
                if m.unhealthy:
                    e["unhealthy"] = True
                if busy and not m.shown_used and not used_slices:
                    e["foreign"] = True
                if m.slices:
                    e["mps"] = [self.slice_entry(n, g, s) for s in m.slices]
                mig.append(e)
            entry: dict[str, Any] = {
                "index": g.index,
                "migEnabled": n.kind != "mps",
                "mig": mig,
                "mps": [self.slice_entry(n, g, s) for s in g.mps],
            }
            if g.unhealthy:
                entry["unhealthy"] = True
            out.append(entry)
        return out

    def slice_entry(self, n: SNode, g: SGpu, s: Slice) -> dict[str, Any]:
        e: dict[str, Any] = {
            "memoryMiB": s.memory,
            "activeThreadPercentage": s.pct,
            "deviceId": self.slice_id(n, g, s),
            "used": s.shown_used,
        }
        if s.unhealthy or g.unhealthy:
            e["unhealthy"] = True
        return e

    def render(self, name: str, report: bool = False) -> None:
        n = self.nodes[name]
        if report:
            for g in n.gpus:
                for m in g.mig:
                    m.shown_used = m.pod is not None
                    for s in m.slices:
                        s.shown_used = s.pod is not None
                for s in g.mps:
                    s.shown_used = s.pod is not None
            np = self.nps[name]
            conds = conditions(n)
            if conds != np["status"]["conditions"]:
                np["status"]["conditions"] = conds
                np["metadata"]["resourceVersion"] = self.next_rv()
        super().render(name)  # allocatable and status.gpus (flags as they stand now)

    def resources(self) -> list[str]:
        out = set()
        for n in self.nodes.values():
            if n.kind != "mps":
                out.update(p.resource for p in n.model.profiles if "+me" not in p.name)
            if n.kind != "mig":
                out.update(MPS_RESOURCES)
        return sorted(out)


def xid(n: SNode) -> bool:
    """Some device of the node carries an XID mark (the status is then Degraded: GpuXid)."""
    return any(g.unhealthy or any(m.unhealthy for m in g.mig) for g in n.gpus)


def conditions(n: SNode) -> list[dict[str, Any]]:
    """The agent's conditions for the spec it last observed: ``Degraded`` if it refused it or
    a device carries an XID mark, else applied."""
    if n.refused or xid(n):
        return [
            {"type": "Applied", "status": "False", "reason": "Degraded"},
            {"type": "Degraded", "status": "True", "reason": "InUse" if n.refused else "GpuXid"},
        ]
    return [{"type": "Applied", "status": "True", "reason": "Applied"}]


# --------------------------------------------------------------------------- generation


def spec_gpus(n: SNode) -> list[dict[str, Any]]:
    out = []
    for g in n.gpus:
        entry: dict[str, Any] = {"index": g.index}
        if n.kind == "mps":
            entry["mps"] = [{"memoryMiB": s.memory, "activeThreadPercentage": s.pct} for s in g.mps]
        else:
            entry["mig"] = [
                {
                    "profile": m.profile,
                    "start": m.start,
                    **(
                        {
                            "mps": [
                                {"memoryMiB": s.memory, "activeThreadPercentage": s.pct}
                                for s in m.slices
                            ]
                        }
                        if m.slices
                        else {}
                    ),
                }
                for m in g.mig
            ]
        out.append(entry)
    return out


def generate(rng: random.Random, counts: Counts, now: float) -> World:
    w = World(rng, counts)
    w.multi_slice = set()
    for k in range(rng.randint(1, 4)):
        model_name = rng.choice(sorted(PRODUCTS))
        model = CAT.model(model_name)
        kind = rng.choices(("mig", "mps", "hybrid"), (4, 3, 3))[0]
        name = f"n{k + 1}"
        gpus = []
        for i in range(rng.randint(1, 4)):
            g = SGpu(i, unhealthy=rng.random() < 0.08)
            if kind == "mps":
                if rng.random() >= 0.15:
                    g.mps = random_slices(rng, usable_mib(model), None)
            else:
                layout = () if rng.random() < 0.15 else rng.choice(LAYOUTS[model_name])
                for pl in layout:
                    m = MInst(pl.profile.name, pl.start, pl.profile.resource)
                    if kind == "hybrid" and rng.random() < 0.5:
                        m.slices = random_slices(rng, instance_usable_mib(pl.profile, SETTINGS), m)
                    g.mig.append(m)
            gpus.append(g)
        n = SNode(name, model, gpus, kind, never_applies=rng.random() < 0.2)
        w.nodes[name] = n
        counts.add(f"{kind}_nodes")
        w.node_objs[name] = {
            "kind": "Node",
            "metadata": {
                "name": name,
                "uid": f"uid-{name}",
                "labels": {
                    "gpuslice.io/partitioning": kind,
                    "nvidia.com/gpu.product": PRODUCTS[model_name],
                    "nvidia.com/gpu.count": str(len(gpus)),
                },
                "resourceVersion": w.next_rv(),
            },
            "spec": {},
            "status": {"allocatable": {}},
        }
        w.nps[name] = {
            "apiVersion": "gpuslice.io/v1alpha1",
            "kind": "NodePartitioning",
            "metadata": {"name": name, "generation": 2, "resourceVersion": w.next_rv()},
            "spec": {"planId": "1", "mode": kind, "gpus": spec_gpus(n)},
            "status": {
                "observedGeneration": 2,
                "planId": "1",
                "gpus": [],
                "conditions": [{"type": "Applied", "status": "True", "reason": "Applied"}],
            },
        }
        busy = rng.random() < 0.15  # a spec (the same layout, a later plan) not observed yet
        if busy:
            w.nps[name]["metadata"]["generation"] = 3
            w.nps[name]["spec"]["planId"] = "4"
        for g in gpus:
            for m in g.mig:
                if m.slices:
                    host_roll = rng.random()
                    m.unhealthy = host_roll < 0.06  # an XID on the host: its slices too
                    m.foreign = host_roll > 0.92  # processes outside any pod on the host
                    for s in m.slices:
                        s.unhealthy = m.unhealthy
                        populate(w, n, g, s, now, busy)
                else:
                    populate(w, n, g, m, now, busy)
            for s in g.mps:
                populate(w, n, g, s, now, busy)
            if g.unhealthy:
                for d in g.insts:
                    d.unhealthy = True  # a GPU-wide mark hits every device
        w.render(name, report=False)
        np = w.nps[name]
        np["status"]["conditions"] = conditions(n)
    for _ in range(rng.choice((1, 1, 2, 3, 5, 8))):
        w.gated_pod(now)
    return w


def populate(w: World, n: SNode, g: SGpu, d: Inst, now: float, busy: bool) -> None:
    """A device's initial state: a running pod, unhealthy, foreign, a lagging flag, a promise."""
    rng = w.rng
    roll = rng.random()
    if roll < 0.3 or (g.unhealthy and roll < 0.5):
        pod = w.new_pod(
            w.name("r"), {d.resource: 1}, now - 3000, rng.choice((0, 0, 50)), node=n.name
        )
        d.pod = f"ns/{pod['metadata']['name']}"
        d.shown_used = rng.random() > 0.1  # just bound: not reported yet
        if not isinstance(d, Slice) or d.host is None:
            d.unhealthy = d.unhealthy or rng.random() < 0.08
    elif roll < 0.42 and not isinstance(d, Slice):
        d.unhealthy = True
    elif roll < 0.5 and isinstance(d, MInst):
        d.foreign = True
    elif roll < 0.55:
        d.shown_used = True  # its pod just ended: the agent has not seen it
    elif not g.unhealthy and d.usable(False) and rng.random() < 0.3:
        promise(w, n, g, d, now, busy)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the agent


def in_use(d: Inst) -> bool:
    """What the agent protects: a pod (PodResources), processes, a flag not caught up, an XID."""
    return bool(d.pod or d.foreign or d.unhealthy or d.shown_used)


def rebuild(
    w: World,
    n: SNode,
    g: SGpu,
    current: list[Slice],
    want: list[tuple[int, int]],
    host: MInst | None,
    owner: str,
) -> list[Slice] | None:
    """The agent's new slice table (:func:`diff_slices`), or ``None`` if a used slice is lost."""
    ids = {w.slice_id(n, g, s): s for s in current}
    slots = tuple(MpsSlot(s.start, s.memory, s.pct, i) for i, s in ids.items())
    used = frozenset(i for i, s in ids.items() if in_use(s))
    table, conflicts = diff_slices(slots, used, want, owner)
    if conflicts:
        return None
    if table is None:
        return current
    out = []
    for slot in table:
        s = ids.get(slot.device_id)
        if s is None:
            s = Slice("", slot.slot, mps_resource(slot.memory_mib // GIB), memory=slot.memory_mib,
                      pct=slot.thread_percentage, host=host)  # fmt: skip
        out.append(s)
    return out


def apply_gpu(w: World, n: SNode, g: SGpu, spec: dict[str, Any]) -> bool | None:
    """Apply GPU ``g``'s spec entry as the agent would: ``None`` if nothing changes, else
    whether it was applied (all or nothing)."""
    rng = w.rng
    if n.kind == "mps":
        want = [(s["memoryMiB"], s["activeThreadPercentage"]) for s in spec.get("mps", ())]
        if Counter(want) == Counter((s.memory, s.pct) for s in g.mps):
            return None
        if g.unhealthy or rng.random() < 0.1:
            return False
        table = rebuild(w, n, g, g.mps, want, None, f"GPU-{n.name}-{g.index}")
        if table is None:
            return False
        g.mps = table
        return True
    desired = {
        (m["profile"], m["start"]): [
            (s["memoryMiB"], s["activeThreadPercentage"]) for s in m.get("mps", ())
        ]
        for m in spec.get("mig", ())
    }
    have = {(m.profile, m.start): Counter((s.memory, s.pct) for s in m.slices) for m in g.mig}
    if have == {k: Counter(v) for k, v in desired.items()}:
        return None
    if g.unhealthy or rng.random() < 0.1:
        return False
    new: list[MInst] = []
    for m in g.mig:
        key = (m.profile, m.start)
        if key not in desired:
            if in_use(m) or any(in_use(s) for s in m.slices):
                return False  # in use, unhealthy: this GPU stays
            continue
        want = desired.pop(key)
        if want and not m.slices and (m.pod or m.shown_used):
            return False  # in use as a whole MIG device: it cannot host slices
        if not want and not m.slices:
            new.append(m)
            continue
        table = rebuild(w, n, g, m.slices, want, m, w.inst_id(n, g, m))
        if table is None:
            return False
        new.append(m)
        m.pending = table  # type: ignore[attr-defined]
    for (profile, start), want in desired.items():
        m = MInst(profile, start, n.model.profile(profile).resource)
        m.pending = [  # type: ignore[attr-defined]
            Slice("", k, mps_resource(mib // GIB), memory=mib, pct=pct, host=m)
            for k, (mib, pct) in enumerate(sorted(want))
        ]
        new.append(m)
    for m in new:
        pending = getattr(m, "pending", None)
        if pending is not None:
            m.slices = pending
            del m.pending  # type: ignore[attr-defined]
    g.mig = sorted(new, key=lambda x: x.start)
    return True


def agent_applies(w: World, broken: set[tuple[str, str]]) -> None:
    """Busy agents apply their spec (or refuse it: Degraded, or never apply)."""
    rng = w.rng
    for name, n in w.nodes.items():
        np = w.nps[name]
        if not is_busy(NodePartitioning.model_validate(np)) or n.never_applies:
            continue
        if rng.random() < 0.4:
            continue
        want = {g["index"]: g for g in np["spec"]["gpus"]}
        refused = False
        for g in n.gpus:
            done = apply_gpu(w, n, g, want.get(g.index, {}))
            if done is False:
                refused = True
            elif done:
                w.counts.add(f"{n.kind}_gpus_changed")
        n.refused = refused
        np["status"]["observedGeneration"] = np["metadata"]["generation"]
        np["status"]["planId"] = np["spec"]["planId"]
        w.counts.add("agent_degraded" if refused else "agent_applied")
        np["metadata"]["resourceVersion"] = w.next_rv()
        w.render(name, report=True)
        if refused:
            free = usable_free(n)  # type: ignore[arg-type]
            broken.update((name, r) for r, k in held_units(w, name).items() if k > free[r])


# --------------------------------------------------------------------------- the kubelet


def daemon(g: SGpu, d: Inst) -> tuple[int, int] | None:
    """The MPS daemon serving device ``d`` (GPU, host start), ``None`` for a MIG device."""
    if not isinstance(d, Slice):
        return None
    return (g.index, d.host.start if d.host is not None else -1)


def scheduler_binds(w: World, broken: set[tuple[str, str]], where: str) -> None:
    """kube-scheduler binds released pods where allocatable has room; the kubelet allocates
    through the agent's preferred allocation, and the agent's Allocate refuses MPS slices of two
    daemons in one container (the pod fails: ``UnexpectedAdmissionError``), which a promise of
    one MPS slice (asserted) never meets.  A released pod whose promise holds must find healthy
    free devices that one allocation can give it."""
    rng = w.rng
    for key, pod in sorted(w.pods.items()):
        r = reservation_of(pod)
        if not waiting(pod) or gated_now(pod) or r is None or r.state is not State.RELEASED:
            continue
        if rng.random() < 0.4:
            continue
        n = w.nodes[r.node]
        alloc = w.node_objs[r.node]["status"]["allocatable"]
        bound = w.bound_units(r.node)
        if any(int(alloc.get(res, 0)) - bound[res] < len(g) for res, g in r.gpus.items()):
            w.counts.add("scheduler_no_room")
            continue
        holds = key in counted(w, r.node, w.pods)
        mps_units = sum(len(ix) for res, ix in r.gpus.items() if mps_gb_of(res) is not None)
        assert mps_units <= 1, f"{where}: {key} released to {r.node} for {dict(r.gpus)}"
        picked: list[tuple[SGpu, Inst]] = []
        refused = ""
        for res, expected in r.gpus.items():
            k = len(expected)
            listed = {
                f"{g.index}/{j}": (g, d)
                for g in n.gpus
                for j, d in enumerate(g.insts)
                if d.resource == res and d.pod is None and not (g.unhealthy or d.unhealthy)
            }
            usable = [(g, d) for g, d in listed.values() if d.usable(g.unhealthy)]
            good = len(usable) >= k
            if holds and (r.node, res) not in broken:
                assert good, (
                    f"{where}: {key} released to {r.node} for {dict(r.gpus)}: no allocation "
                    f"gives it {k} healthy free {res}\n" + describe(w, r.node, w.pods)  # type: ignore[arg-type]
                )
            else:
                w.counts.add("scheduler_broken", not good)
            if len(listed) < k:
                break  # the kubelet has too few: kube-scheduler's count was off; it waits
            ids = preferred_allocation(sorted(listed), [], k, lambda i: i.split("/", 1)[0])
            chosen = [listed[i] for i in ids]
            if len({daemon(g, d) for g, d in chosen}) > 1:
                refused = f"MPS slices of different daemons for {res}"
            w.counts.add("kubelet_unusable_pick", any(not d.usable(g.unhealthy) for g, d in chosen))
            picked += chosen
        # one MPS slice per promise (asserted above): one daemon, so Allocate never refuses
        assert not refused, f"{where}: {key} released to {r.node}: Allocate refuses {refused}"
        if sum(len(g) for g in r.gpus.values()) != len(picked):
            continue
        free_before = usable_free(n)  # type: ignore[arg-type]
        for _, d in picked:
            d.pod = key
        pod["spec"]["nodeName"] = r.node
        pod["status"]["phase"] = "Running"
        pod["metadata"]["resourceVersion"] = w.next_rv()
        w.counts.add("binds")
        w.counts.add(f"binds_{n.kind}")
        w.render(r.node)
        if not holds:
            took_promised(w, r.node, free_before, usable_free(n), broken)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- outside events


def outside_events(w: World, now: float, broken: set[tuple[str, str]]) -> None:
    rng = w.rng
    for name in w.nodes:
        if rng.random() < 0.5:
            w.render(name, report=True)
    # A pod leaving a hybrid host that runs processes of no pod (which the agent could not
    # tell apart while the pod held a slice) reveals them: the host's other slices, one a
    # promise may name, turn unusable.  An outside event like an XID.
    free_before = {name: usable_free(n) for name, n in w.nodes.items()}  # type: ignore[arg-type]
    running = [k for k, p in sorted(w.pods.items()) if p["spec"].get("nodeName")]
    for key in running:
        if rng.random() < 0.08:
            pod = w.pods.pop(key)
            for g in w.nodes[pod["spec"]["nodeName"]].gpus:
                for d in itertools.chain(g.mig, g.insts):
                    if d.pod == key:
                        d.pod = None
            w.counts.add("finished")
    for name, n in w.nodes.items():
        before = len(broken)
        mark_broken(w, name, free_before[name], usable_free(n), broken)  # type: ignore[arg-type]
        w.counts.add("departure_reveals_foreign", len(broken) > before)
    for name, n in w.nodes.items():
        if is_busy(NodePartitioning.model_validate(w.nps[name])) or rng.random() > 0.25:
            continue
        g = rng.choice(n.gpus)
        before = usable_free(n), admitted(w, name)  # type: ignore[arg-type]
        roll = rng.random()
        if roll < 0.15 or (n.kind == "mps" and roll < 0.4):
            g.unhealthy = not g.unhealthy  # not MIG-scoped: every device of the GPU
            for d in itertools.chain(g.mig, g.insts):
                d.unhealthy = g.unhealthy
            w.counts.add("gpu_xid")
        elif g.mig and roll < 0.5:
            m = rng.choice(g.mig)
            m.unhealthy = not m.unhealthy  # an instance's XID marks the slices it hosts
            for s in m.slices:
                s.unhealthy = m.unhealthy
            w.counts.add("host_xid" if m.slices else "instance_xid")
        elif g.mig and roll < 0.85:
            m = rng.choice(g.mig)
            if m.pod is None and not any(s.pod for s in m.slices):
                m.foreign = not m.foreign
                w.counts.add("host_foreign" if m.slices else "instance_foreign")
        after = usable_free(n), admitted(w, name)  # type: ignore[arg-type]
        mark_health_broken(w, name, before, after, broken)
        w.counts.add("health_events")
        w.render(name, report=True)
    if rng.random() < 0.3:
        w.gated_pod(now)
        w.counts.add("arrivals")


# --------------------------------------------------------------------------- properties


def hidden_foreign(n: SNode, res: str) -> bool:
    """The status hides that a free device of ``res`` is foreign: the kubelet gave it to a pod
    beside processes of no pod (the agent advertises foreign devices and its preferred
    allocation does not avoid them), the pod left, and the agent's last report, made while
    the pod held it, shows it used and not foreign.  Every controller then reads a departed
    pod's device, free; the agent's next report shows it foreign.  Treated as broken from
    outside.  Likewise a hybrid host with such
    processes whose slices' pods all left while the last report shows one of them used."""
    for g in n.gpus:
        for d in g.insts:
            if d.resource == res and d.foreign and d.pod is None and d.shown_used:
                return True
        for m in g.mig:
            if (
                m.foreign
                and any(s.resource == res for s in m.slices)
                and not any(s.pod for s in m.slices)
                and any(s.shown_used for s in m.slices)
            ):
                return True
    return False


def status_devices(gpu: dict[str, Any]) -> list[tuple[str, bool, tuple[Any, ...]]]:
    """(resource, usable, identity) of each device a status GPU entry lists."""
    out = []
    sick = bool(gpu.get("unhealthy"))
    for m in gpu.get("mig", ()):
        if m.get("mps"):
            host_bad = sick or m.get("unhealthy") or m.get("foreign")
            for s in m["mps"]:
                bad = host_bad or s.get("unhealthy")
                key = (
                    "host",
                    m["profile"],
                    m["start"],
                    s["memoryMiB"],
                    s["activeThreadPercentage"],
                )
                out.append((mps_resource(s["memoryMiB"] // GIB), not bad, key))
        else:
            bad = sick or m.get("unhealthy") or m.get("foreign")
            res = CAT_RESOURCE.get(m["profile"], f"nvidia.com/mig-{m['profile']}")
            out.append((res, not bad, ("mig", m["profile"], m["start"])))
    for s in gpu.get("mps", ()):
        bad = sick or s.get("unhealthy")
        key = ("mps", s["memoryMiB"], s["activeThreadPercentage"])
        out.append((mps_resource(s["memoryMiB"] // GIB), not bad, key))
    return out


CAT_RESOURCE = {p.name: p.resource for name in PRODUCTS for p in CAT.model(name).profiles}


def spec_devices(gpu: dict[str, Any]) -> Counter[str]:
    out: Counter[str] = Counter()
    for m in gpu.get("mig", ()):
        if m.get("mps"):
            out.update(mps_resource(s["memoryMiB"] // GIB) for s in m["mps"])
        else:
            out[CAT_RESOURCE.get(m["profile"], "")] += 1
    out.update(mps_resource(s["memoryMiB"] // GIB) for s in gpu.get("mps", ()))
    return out


def check_new_reservations(
    w: World,
    before: dict[str, Any],
    status_before: dict[str, list[dict[str, Any]]],
    applied: base.Applied,
    where: str,
) -> int:
    """Property 2 on the promises made this step (see the MIG test), plus one MPS slice per
    promise (:func:`check_one_mps_slice` checks every promise held)."""
    made = 0
    for key, r in holders(w.pods).items():
        old = before.get(key)
        same = old is not None and (old.node, dict(old.gpus), old.plan) == (
            r.node,
            dict(r.gpus),
            r.plan,
        )
        if same and (r.since == old.since or r.state is not old.state):
            continue
        made += 1
        w.counts.add(f"reserved_{w.nodes[r.node].kind}")
        status = {g["index"]: g for g in status_before[r.node]}
        spec = applied.written.get(r.node)
        mps_units = sum(len(ix) for res, ix in r.gpus.items() if mps_gb_of(res) is not None)
        assert mps_units <= 1, (
            f"{where}: {key} reserved {mps_units} MPS slices on node {r.node} "
            f"({dict(r.gpus)}): a container reaches one MPS daemon, so one slice per pod"
        )
        w.counts.add("mps_reservations", mps_units)
        for res, indices in r.gpus.items():
            for gpu, k in Counter(indices).items():
                sg = status.get(gpu, {})
                sick = bool(sg.get("unhealthy"))
                devices = [d for d in status_devices(sg) if d[0] == res]
                bad = sum(1 for d in devices if not d[1])
                if r.plan and spec is not None:
                    (sp,) = [g for g in spec["gpus"] if g["index"] == gpu] or [{}]
                    good = spec_devices(sp)[res] - bad
                else:
                    good = len(devices) - bad
                assert not sick and good >= k, (
                    f"{where}: {key} reserved {res} on node {r.node} GPU {gpu} "
                    f"({dict(r.gpus)}, plan {r.plan or '-'}), which has {good} healthy "
                    f"non-foreign such device(s) (GPU unhealthy: {sick}; status {devices})"
                )
    return made


def check_one_mps_slice(w: World, d: Decision | None, where: str, rejected: set[str]) -> None:
    """Property 5: no pod carries a reservation of more than one MPS slice (whatever its
    state), so a pod asking for more is never reserved; the pods ``d`` rejects for asking
    more (an ``Unplaceable`` event, or the gate given back) join ``rejected``."""
    for key, pod in w.pods.items():
        r = reservation_of(pod)
        if key in w.multi_slice:
            assert r is None, (
                f"{where}: {key} asks for more than one MPS slice "
                f"({pod['spec']['containers'][0]['resources']['limits']}) and is reserved {r}"
            )
            w.counts.add("mps_multi_slice_unreserved")
        elif r is not None:
            units = sum(len(ix) for res, ix in r.gpus.items() if mps_gb_of(res) is not None)
            assert units <= 1, f"{where}: {key} holds {units} MPS slices: {r}"
    for a in d.actions if d is not None else ():
        for e in a.on_success if isinstance(a, PatchPod) else (a,):
            if not isinstance(e, EmitEvent) or e.ref.kind != "Pod":
                continue
            key = f"{e.ref.namespace}/{e.ref.name}"
            if key not in w.multi_slice or key not in w.pods:
                assert "a container reaches one MPS daemon" not in e.message, (where, e)
                continue
            limits = w.pods[key]["spec"]["containers"][0]["resources"]["limits"]
            why = one_mps_slice({r: int(k) for r, k in limits.items()})
            # "cannot place: <why>" (Unplaceable) or "gpuslice cannot place it (<why>): ..."
            # (the gate given back)
            if why is not None and "cannot place" in e.message and why in e.message:
                rejected.add(key)


def check_specs_keep(
    w: World, status_before: dict[str, list[dict[str, Any]]], applied: base.Applied, where: str
) -> None:
    """No spec drops (or reshapes) a device, instance or host the status reports used,
    unhealthy or foreign."""
    for name, spec in applied.written.items():
        want = {g["index"]: g for g in spec["gpus"]}
        for g in status_before[name]:
            sp = want.get(g["index"], {})
            w.counts.add("specs_checked_gpus")
            insts = {(m["profile"], m["start"]): m for m in sp.get("mig", ())}
            for m in g.get("mig", ()):
                keep = m.get("used") or m.get("unhealthy") or m.get("foreign") or g.get("unhealthy")
                kept = insts.get((m["profile"], m["start"]))
                if keep:
                    assert kept is not None, (
                        f"{where}: the spec written for node {name} drops GPU {g['index']}'s "
                        f"{m['profile']}@{m['start']}, which the status reports {m}"
                    )
                if m.get("used") and not m.get("mps") and kept is not None:
                    assert not kept.get("mps"), (
                        f"{where}: the spec written for node {name} makes GPU {g['index']}'s "
                        f"{m['profile']}@{m['start']}, in use as a whole, a host of MPS slices"
                    )
                if m.get("mps") and kept is not None:
                    held = Counter(
                        (s["memoryMiB"], s["activeThreadPercentage"])
                        for s in m["mps"]
                        if s.get("used") or s.get("unhealthy") or (keep and m.get("unhealthy"))
                    )
                    have = Counter(
                        (s["memoryMiB"], s["activeThreadPercentage"]) for s in kept.get("mps", ())
                    )
                    assert not held - have, (
                        f"{where}: the spec written for node {name} drops slices {held - have} "
                        f"of GPU {g['index']}'s host {m['profile']}@{m['start']}"
                    )
            held = Counter(
                (s["memoryMiB"], s["activeThreadPercentage"])
                for s in g.get("mps", ())
                if s.get("used") or s.get("unhealthy")
            )
            have = Counter((s["memoryMiB"], s["activeThreadPercentage"]) for s in sp.get("mps", ()))
            assert not held - have, (
                f"{where}: the spec written for node {name} drops MPS slices {held - have} of "
                f"GPU {g['index']}, which the status reports used or unhealthy"
            )


# --------------------------------------------------------------------------- one run


def run_cluster(seed: int, counts: Counts) -> None:
    rng = random.Random(seed)
    start = T0 + rng.randint(0, 1000)
    w = generate(rng, counts, start)
    counts.add("states")
    for n in w.nodes.values():
        for g in n.gpus:
            counts.add("gpus")
            counts.add("unhealthy_gpus", g.unhealthy)
            counts.add("hosts", sum(1 for m in g.mig if m.slices))
            counts.add("foreign_hosts", sum(1 for m in g.mig if m.slices and m.foreign))
            for d in g.insts:
                counts.add("slices" if isinstance(d, Slice) else "instances")
                counts.add("unhealthy_devices", d.unhealthy)
                counts.add("lagging_used_flags", d.shown_used != (d.pod is not None))
    broken: set[tuple[str, str]] = set()
    check_no_overpromise(w, holders(w.pods), broken, f"seed {seed} initial", hidden=hidden_foreign)  # type: ignore[arg-type]
    ctl = Running()
    rejected: set[str] = set()  # multi-slice MPS pods the running controller rejected
    for _step, now, where in step_times(rng, seed, start):
        seen_multi = w.multi_slice & w.pods.keys()  # the pods this step's decide reads
        s = decide_step(w, ctl, now, where, counts)
        for name in s.applied.written:
            counts.add(f"specs_{w.nodes[name].kind}")

        check_no_overpromise(w, s.before, broken, where, hidden=hidden_foreign)  # type: ignore[arg-type]
        counts.add(
            "reservations_made",
            check_new_reservations(w, s.before, s.status_before, s.applied, where),
        )
        check_specs_keep(w, s.status_before, s.applied, where)
        check_one_mps_slice(w, s.d, where, rejected)
        check_one_mps_slice(s.restarted, None, f"{where} (restarted)", set())
        missed = seen_multi - rejected
        assert not missed, f"{where}: multi-slice MPS pods {sorted(missed)} not rejected"

        check_restart_keeps(w, s, where, counts)
        check_no_overpromise(
            s.restarted,
            s.before,
            set(broken),
            f"{where} (restarted)",
            s.restarted.pods,
            hidden=hidden_foreign,
        )
        heal(w, broken, lambda name: promise_capacity(w, name, usable_free(w.nodes[name])))  # type: ignore[arg-type]

        agent_applies(w, broken)
        scheduler_binds(w, broken, where)
        outside_events(w, now, broken)
    counts.add("mps_multi_slice_rejected", len(rejected))


def test_promises_stay_sound_on_random_mps_and_hybrid_clusters() -> None:
    counts = run_seeds("shares", run_cluster, ONLY_SEED, BASE_SEED, CLUSTERS)
    if ONLY_SEED:
        return
    assert_exercised(
        counts,
        {
            "states": CLUSTERS,
            "steps": 5 * CLUSTERS,
            "restart_kept": CLUSTERS,
            "reservations_made": CLUSTERS,
            "reserved_mps": CLUSTERS // 4,
            "reserved_hybrid": CLUSTERS // 4,
            "reserved_mig": CLUSTERS // 4,
            "mps_reservations": CLUSTERS // 2,
            "mps_multi_slice_pods": CLUSTERS // 4,
            "mps_multi_slice_rejected": CLUSTERS // 4,
            "mps_multi_slice_unreserved": CLUSTERS,
            "specs_mps": CLUSTERS // 10,
            "specs_hybrid": CLUSTERS // 10,
            "mps_gpus_changed": CLUSTERS // 20,
            "hybrid_gpus_changed": CLUSTERS // 20,
            "binds_mps": CLUSTERS // 10,
            "binds_hybrid": CLUSTERS // 10,
            "releases": CLUSTERS // 2,
            "fast_reservations": CLUSTERS // 2,
            "hosts": CLUSTERS // 2,
            "foreign_hosts": CLUSTERS // 20,
            "host_xid": CLUSTERS // 20,
            "gpu_xid": CLUSTERS // 10,
            "host_foreign": CLUSTERS // 20,
            "lagging_used_flags": CLUSTERS // 4,
            "agent_degraded": CLUSTERS // 25,
            "dropped": CLUSTERS // 10,
        },
    )


# --------------------------------------------------------------------------- regressions
# Each was found by the test above (seed in its docstring); each fails without its fix.


def mps_np(name: str, *gpus: dict[str, Any]) -> dict[str, Any]:
    """An MPS node's NodePartitioning whose agent applied plan 1 and reports ``gpus``."""
    obj = np_obj(
        name, plan="1", generation=2, observed=2, applied=True, gpus=list(gpus), mode="mps"
    )
    obj["spec"]["gpus"] = [
        {
            "index": g["index"],
            "mps": [
                {"memoryMiB": s["memoryMiB"], "activeThreadPercentage": s["activeThreadPercentage"]}
                for s in g["mps"]
            ],
        }
        for g in gpus
    ]
    return obj


def mps_gpu(index: int, *slices: tuple[int, bool], unhealthy: bool = False) -> dict[str, Any]:
    """Status of an MPS GPU: slices (GiB, used)."""
    usable = CAT.model("A100-SXM4-80GB").memory_mib - RESERVE
    out: dict[str, Any] = {
        "index": index,
        "migEnabled": False,
        "mps": [
            {
                "memoryMiB": gb * GIB,
                "activeThreadPercentage": thread_percentage(
                    gb * GIB, usable, SETTINGS.mps_thread_policy
                ),
                "deviceId": f"GPU-{index}-mps{k}-{gb * GIB}m",
                "used": used,
            }
            for k, (gb, used) in enumerate(slices)
        ],
    }
    if unhealthy:
        out["unhealthy"] = True
    return out


def test_no_plan_puts_a_slice_on_an_mps_gpu_unhealthy_as_a_whole() -> None:
    """Seed 20271208.  GPU 1 of an MPS node is unhealthy as a whole (an XID on the GPU) and
    empty; GPU 0 has no room for 40 GiB.  The ledger marks GPU 1 locked, which the planners
    honour on MIG GPUs only: the plan gave the 40 GiB pod a new slice on GPU 1, which the
    agent advertises Unhealthy, so the pod was promised what the kubelet never gives."""
    held = [("nvidia.com/gpu-40gb", 40), ("nvidia.com/gpu-20gb", 20), ("nvidia.com/gpu-10gb", 10)]
    c = Cluster(
        with_alloc_mps(node("n1", MPS_A100), {r: 1 for r, _ in held}),
        mps_np("n1", mps_gpu(0, *[(gb, True) for _, gb in held]), mps_gpu(1, unhealthy=True)),
        *[running(f"r{gb}", "n1", r) for r, gb in held],
        gated("p", "nvidia.com/gpu-40gb"),
    )
    c.step(T0)  # opens the window
    d = c.step(T0 + 11)
    specs = [a for a in d.actions if isinstance(a, WriteSpec)]
    assert specs == [] and reservation(c, "p") is None, (specs, reservation(c, "p"))
    # a healthy GPU 1 takes it
    c = Cluster(
        with_alloc_mps(node("n1", MPS_A100), {r: 1 for r, _ in held}),
        mps_np("n1", mps_gpu(0, *[(gb, True) for _, gb in held]), mps_gpu(1)),
        *[running(f"r{gb}", "n1", r) for r, gb in held],
        gated("p", "nvidia.com/gpu-40gb"),
    )
    c.step(T0)
    d = c.step(T0 + 11)
    (w,) = [a for a in d.actions if isinstance(a, WriteSpec)]
    assert [s.memoryMiB for s in w.spec.gpus[1].mps] == [40 * GIB]
    r = reservation(c, "p")
    assert r is not None and dict(r.gpus) == {"nvidia.com/gpu-40gb": (1,)}


def with_alloc_mps(obj: dict[str, Any], units: dict[str, int]) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    obj["status"]["allocatable"].update({r: str(k) for r, k in units.items()})
    return obj


HYBRID_ONE = {"gpuslice.io/partitioning": "hybrid", **A100, "nvidia.com/gpu.count": "1"}


def hybrid_np(name: str, *gpus: dict[str, Any]) -> dict[str, Any]:
    """A hybrid node's NodePartitioning whose agent applied plan 1 and reports ``gpus``."""
    obj = np_obj(
        name, plan="1", generation=2, observed=2, applied=True, gpus=list(gpus), mode="hybrid"
    )
    obj["spec"]["gpus"] = [
        {
            "index": g["index"],
            "mig": [
                {
                    "profile": m["profile"],
                    "start": m["start"],
                    "mps": [
                        {k: s[k] for k in ("memoryMiB", "activeThreadPercentage")}
                        for s in m.get("mps", ())
                    ],
                }
                for m in g["mig"]
            ],
        }
        for g in gpus
    ]
    return obj


def foreign_host_gpu(held_4g: bool = False) -> dict[str, Any]:
    """GPU 0: a 4g.40gb at 0 (free, or held by a pod) and a 3g.40gb at 4 hosting a free
    10 GiB slice, on which processes of no pod run (the agent reports the host used and
    foreign)."""
    return {
        "index": 0,
        "migEnabled": True,
        "mig": [
            {"profile": "4g.40gb", "start": 0, "deviceId": "MIG-a", "used": held_4g},
            {
                "profile": "3g.40gb",
                "start": 4,
                "deviceId": "MIG-b",
                "used": True,
                "foreign": True,
                "mps": [
                    {"memoryMiB": 10240, "activeThreadPercentage": 26,
                     "deviceId": "MIG-b-mps0-10240m-26p", "used": False},
                ],
            },
        ],
    }  # fmt: skip


def test_a_hybrid_host_the_agent_reports_foreign_is_kept_and_its_slices_not_offered() -> None:
    """Seed 20271237.  A hybrid host instance runs processes of no pod (``foreign``), its one
    slice free.  A host is pinned only through its slices, so the plan for a 7g pod replaced
    the host (the agent refuses: the instance is in use; Degraded), and the free slice was
    offered to a 10 GiB pod, which would share the instance with those processes."""
    alloc = {"nvidia.com/gpu-10gb": 1, "nvidia.com/mig-4g.40gb": 1}
    c = Cluster(
        with_alloc_mps(node("n1", HYBRID_ONE), alloc),
        hybrid_np("n1", foreign_host_gpu()),
        gated("big", SEVEN_G),
    )
    c.step(T0)  # opens the window
    d = c.step(T0 + 11)
    assert not [a for a in d.actions if isinstance(a, WriteSpec)]
    assert reservation(c, "big") is None
    c = Cluster(
        with_alloc_mps(node("n1", HYBRID_ONE), alloc),
        hybrid_np("n1", foreign_host_gpu()),
        gated("p", "nvidia.com/gpu-10gb"),
    )
    c.step(T0)
    d = c.step(T0 + 11)
    r = reservation(c, "p")
    assert r is None or r.plan, r  # never the foreign host's free slice
    for w in [a for a in d.actions if isinstance(a, WriteSpec)]:
        (host,) = [m for m in w.spec.gpus[0].mig if m.start == 4]
        assert host.profile == "3g.40gb" and len(host.mps) >= 1


def test_no_plan_adds_a_slice_to_a_hybrid_host_the_agent_reports_foreign() -> None:
    """Seed 30002093.  The foreign host (processes of no pod, one free 10 GiB slice) has room
    for 24 GiB more, and the GPU's 4g.40gb is held by a pod.  Its slices counted as used, so
    the host was pinned like one a pod uses, and a plan added a 5 GiB slice beside those
    processes and promised it to a 5 GiB pod.  A foreign host is now sealed: kept exactly,
    nothing added, nothing offered; the pod waits (unplaced), and no spec is written."""
    alloc = {"nvidia.com/gpu-10gb": 1, "nvidia.com/mig-4g.40gb": 1}
    c = Cluster(
        with_alloc_mps(node("n1", HYBRID_ONE), alloc),
        hybrid_np("n1", foreign_host_gpu(held_4g=True)),
        running("r4", "n1", "nvidia.com/mig-4g.40gb"),
        gated("p", "nvidia.com/gpu-5gb"),
    )
    c.step(T0)  # opens the window
    d = c.step(T0 + 11)
    assert not [a for a in d.actions if isinstance(a, WriteSpec)], d.actions
    assert reservation(c, "p") is None, reservation(c, "p")
    # the same host without the foreign processes takes the slice
    gpu = foreign_host_gpu(held_4g=True)
    gpu["mig"][1].update(used=False, foreign=False)
    c = Cluster(
        with_alloc_mps(node("n1", HYBRID_ONE), alloc),
        hybrid_np("n1", gpu),
        running("r4", "n1", "nvidia.com/mig-4g.40gb"),
        gated("p", "nvidia.com/gpu-5gb"),
    )
    c.step(T0)
    d = c.step(T0 + 11)
    (w,) = [a for a in d.actions if isinstance(a, WriteSpec)]
    (host,) = [m for m in w.spec.gpus[0].mig if m.start == 4]
    assert sorted(s.memoryMiB for s in host.mps) == [5 * 1024, 10 * 1024]
    r = reservation(c, "p")
    assert r is not None and dict(r.gpus) == {"nvidia.com/gpu-5gb": (0,)}, r
