"""Randomized property test: a reservation is a promise, and promises are sound.

On many random small clusters, driven through the real decision step
(:func:`partitioner.decide.decide`), with a simulated API server, node agent, kubelet and
kube-scheduler around it, after every step:

1. **No over-promise.**  Per node and resource, the units of ``released`` reservations of pods
   not bound yet, plus those of ``planned`` ones on a node that is not applying a spec (their
   slices exist: the ledger's holds, :mod:`partitioner.ledger`; a released pod re-planned on
   its node for the spec being applied waits for that spec), never exceed the instances of that
   resource that are healthy (instance and GPU), not ``foreign`` and held by no bound pod.
   This is what :meth:`NodeLedger.free <partitioner.ledger.NodeLedger.free>` intends
   (``total - bound - held - nominated - unhealthy``, ``unhealthy`` being the unhealthy devices
   no pod uses and every foreign one), stated on the ground truth the simulator keeps (which
   pod sits on which instance), not on the agent's ``used`` flags, which lag.  A promise broken
   from outside (an instance a hold counted on turns unhealthy or foreign, the agent refuses a
   spec) may stay broken while its pod is re-planned (a released pod stays pinned to its node);
   on such a (node, resource) a step may add a new promise only if it fits beside the promises
   the controller still keeps (its view, ``status.reservations``).
2. **No promise of an unusable device.**  A reservation made from existing slices (no plan id:
   the fast path, or a plan that changed nothing on the node) names, per GPU, no more units of
   a resource than that GPU has healthy, non-foreign instances of it; one made for a plan
   names GPUs the written spec gives such instances (never a GPU unhealthy as a whole).  A
   spec never drops an instance the status reports used, unhealthy or foreign.  A released
   pod whose promise holds always gets a healthy, non-foreign device when it binds.
3. **Restart.**  A fresh controller (``ControllerState()`` and an index built from the same
   objects, as after a restart) stepped at the same time drops no reservation the running
   controller keeps, moves none to another node, and makes no second reservation for a pod
   that holds one; it keeps every cool-down the running controller recorded on a
   NodePartitioning; its outcome satisfies 1 as well.
4. **Determinism.**  The same objects, state and time give the same actions.

The running controller reads an index kept up to date the way the operator's is
(:meth:`ClusterIndex.relist <partitioner.index.ClusterIndex.relist>` every step), so it sees
that pods changed since the agent's last report; a fresh index cannot, and is held to the same
bar: where the flags could mislead it (a pod left an unhealthy instance the agent still reports
used while a new pod holds one it reports free, equal counts), what kube-scheduler admits caps
the ledger's count, and beside a foreign instance, which kube-scheduler admits but no pod can
use, the ledger trusts the flags not at all (``partitioner.ledger._flags_decide``).

Generator: a seeded :class:`random.Random` per cluster, not hypothesis: a case is a simulation
of many coupled objects over several steps, where shrinking helps little and hypothesis' health
checks and example database only cost time; a failure names its seed, and
``GPUSLICE_PROMISE_SEED=<seed>`` replays that cluster alone (``-s`` prints the counts).  Each
cluster has 1-4 MIG nodes (A100-SXM4-80GB / H100-80GB, 1-4 GPUs each), each GPU a valid random
layout (:func:`planner.geometry.enumerate_layouts`, 15 % empty) whose instances are free, used
by a bound running pod, unhealthy (also under a running pod), foreign (used by processes of no
pod), or on a GPU unhealthy as a whole (8 %); node allocatable lists the instances the agent
advertises healthy (foreign ones included, as its device plugin does).  The agent's ``used``
flags lag at first (a pod just bound shows free, a departed pod's instance still shows used)
and catch up whenever the agent writes its status.  1-8 gated pods ask for 1-2 units of a
random profile, some with priorities, some old enough to be drained; some pods already carry
``planned`` or ``released`` reservations on free healthy instances, some nodes have a spec
not applied yet.  Then 6-10 steps, 1-305 s apart (across the batch window, the bind and apply
deadlines and the drain threshold); between steps busy agents apply their spec (or report
``Degraded``; 20 % of nodes never apply), kube-scheduler binds released pods where allocatable
has room (the kubelet giving a healthy free device, the expected GPU first), pods finish,
agents resync, instances turn unhealthy or foreign or recover, new pods arrive.  The planner
is the greedy one (the reservation logic is the same for any planner; CP-SAT would cost
seconds a batch).

Every step runs the decision four times (the running controller, twice more for determinism,
once restarted: :func:`decide_step`).  Counts of what was exercised are asserted to be
non-trivial.  The MPS/hybrid and DRA harnesses (``test_partitioner_promise_soundness_shares``,
``test_partitioner_promise_soundness_dra``) run their worlds through the same step core
(:func:`step_times`, :func:`decide_step`, :func:`check_restart_keeps`, :func:`heal`,
:func:`run_seeds`), adding their own checks.  Default 250
clusters, about 30 s on 2 cores; ``GPUSLICE_PROMISE_CLUSTERS`` and ``GPUSLICE_PROMISE_BASE``
(the first seed) run others.
"""

from __future__ import annotations

import copy
import datetime
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from test_partitioner_promises import (
    CONFIG,
    MIG,
    ONE_G,
    SEVEN_G,
    T0,
    Cluster,
    applied_np,
    events,
    gated,
    reservation,
    running,
    status_gpu,
    with_alloc,
)
from test_partitioner_snapshot import node
from test_partitioner_snapshot import np as np_obj

from contract.nodepartitioning import NodePartitioning
from partitioner.actions import (
    CreatePartitioning,
    DeletePartitioning,
    EmitEvent,
    EvictPod,
    MarkCooldown,
    PatchPod,
    SetNodeCondition,
    WriteReservations,
    WriteSpec,
)
from partitioner.decide import ControllerState, Decision, decide, is_busy
from partitioner.gating import GATE, release_patch
from partitioner.index import ClusterIndex
from partitioner.reservations import RESERVATION_ANNOTATION, Reservation, State, parse_reservation
from partitioner.snapshot import COOLDOWN_ANNOTATION, cooldown_annotation
from planner.catalog import GpuModel, default_catalog
from planner.geometry import enumerate_layouts
from simulations.replay.kube_rules import merge_patch, validate_pod_update

CAT = default_catalog()
PRODUCTS = {"A100-SXM4-80GB": "NVIDIA-A100-SXM4-80GB", "H100-80GB": "NVIDIA-H100-80GB-HBM3"}
LAYOUTS = {name: tuple(enumerate_layouts(CAT.model(name))) for name in PRODUCTS}
CLUSTERS = int(os.environ.get("GPUSLICE_PROMISE_CLUSTERS", "250"))
ONLY_SEED = os.environ.get("GPUSLICE_PROMISE_SEED")
BASE_SEED = int(os.environ.get("GPUSLICE_PROMISE_BASE", "20261201"))
STEPS = (6, 10)
GAPS = (1, 2, 5, 11, 30, 61, 61, 125, 305)


# --------------------------------------------------------------------------- the world


@dataclass
class Inst:
    profile: str
    start: int
    resource: str
    pod: str | None = None
    """The bound pod holding it (ground truth), if any."""
    unhealthy: bool = False
    foreign: bool = False
    shown_used: bool = False
    """The agent's last reported ``used`` flag (lags the pods)."""

    def usable(self, gpu_sick: bool) -> bool:
        return not (gpu_sick or self.unhealthy or self.foreign)


@dataclass
class Gpu:
    index: int
    insts: list[Inst] = field(default_factory=list)
    unhealthy: bool = False


@dataclass
class SimNode:
    name: str
    model: GpuModel
    gpus: list[Gpu]
    never_applies: bool = False


@dataclass
class Counts:
    c: Counter[str] = field(default_factory=Counter)

    def add(self, key: str, n: int = 1) -> None:
        self.c[key] += n


def _stamp(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class World:
    """Objects as the API server holds them, plus the ground truth behind the agent's status."""

    def __init__(self, rng: random.Random, counts: Counts) -> None:
        self.rng, self.counts = rng, counts
        self.rv = 10
        self.nodes: dict[str, SimNode] = {}
        self.node_objs: dict[str, dict[str, Any]] = {}
        self.nps: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}
        self.serial = 0

    def next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    # ------------------------------------------------------------------ rendering

    def status_gpus(self, n: SimNode) -> list[dict[str, Any]]:
        out = []
        for g in n.gpus:
            mig = []
            for i in g.insts:
                m: dict[str, Any] = {
                    "profile": i.profile,
                    "start": i.start,
                    "deviceId": f"MIG-{n.name}-{g.index}-{i.start}",
                    "used": i.shown_used or i.foreign,
                }
                if i.unhealthy:
                    m["unhealthy"] = True
                if i.foreign:
                    m["foreign"] = True
                mig.append(m)
            entry: dict[str, Any] = {"index": g.index, "migEnabled": True, "mig": mig}
            if g.unhealthy:
                entry["unhealthy"] = True
            out.append(entry)
        return out

    def render(self, name: str, report: bool = False) -> None:
        """Node allocatable and the NodePartitioning status from the ground truth; ``report``:
        the agent writes a fresh report (its ``used`` flags catch up)."""
        n = self.nodes[name]
        if report:
            for g in n.gpus:
                for i in g.insts:
                    i.shown_used = i.pod is not None
        alloc: dict[str, str] = {"cpu": "16", "memory": "64Gi"}
        listed: Counter[str] = Counter()
        for g in n.gpus:
            for i in g.insts:
                if not (g.unhealthy or i.unhealthy):  # the kubelet lists healthy devices
                    listed[i.resource] += 1
        alloc.update({r: str(k) for r, k in listed.items()})
        obj = self.node_objs[name]
        if obj["status"]["allocatable"] != alloc:
            obj["status"]["allocatable"] = alloc
            obj["metadata"]["resourceVersion"] = self.next_rv()
        np = self.nps[name]
        gpus = self.status_gpus(n)
        if np["status"]["gpus"] != gpus:
            np["status"]["gpus"] = gpus
            np["metadata"]["resourceVersion"] = self.next_rv()

    # ------------------------------------------------------------------ pods

    def new_pod(
        self,
        name: str,
        units: dict[str, int],
        created: float,
        priority: int = 0,
        node: str = "",
    ) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "containers": [
                {"name": "c", "resources": {"limits": {r: str(k) for r, k in units.items()}}}
            ]
        }
        return self.put_pod(name, spec, created, priority, node)

    def put_pod(
        self, name: str, spec: dict[str, Any], created: float, priority: int, node: str
    ) -> dict[str, Any]:
        """Add pod ``name`` with ``spec`` (its containers): bound to ``node`` and running, or
        gated and pending (also the DRA harness's claim pods)."""
        if priority:
            spec["priority"] = priority
        if node:
            spec["nodeName"] = node
        else:
            spec["schedulingGates"] = [{"name": GATE}]
        pod = {
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": "ns",
                "uid": f"uid-{name}",
                "resourceVersion": self.next_rv(),
                "creationTimestamp": _stamp(created),
            },
            "spec": spec,
            "status": {"phase": "Running" if node else "Pending"},
        }
        self.pods[f"ns/{name}"] = pod
        return pod

    def name(self, prefix: str) -> str:
        self.serial += 1
        return f"{prefix}{self.serial}"

    def resources(self) -> list[str]:
        out = set()
        for n in self.nodes.values():
            for p in n.model.profiles:
                if "+me" not in p.name:
                    out.add(p.resource)
        return sorted(out)

    def gated_pod(self, now: float) -> None:
        rng = self.rng
        units = {rng.choice(self.resources()): 2 if rng.random() < 0.2 else 1}
        created = now - rng.choice((0, 0, 5, 100, 700, 2000))
        priority = rng.choice((0, 0, 0, 0, 100, 1000))
        self.new_pod(self.name("g"), units, created, priority)

    def bound_units(self, node: str) -> Counter[str]:
        out: Counter[str] = Counter()
        for p in self.pods.values():
            if p["spec"].get("nodeName") == node and p["status"]["phase"] in ("Running", "Pending"):
                for r, v in p["spec"]["containers"][0]["resources"]["limits"].items():
                    out[r] += int(v)
        return out

    # ------------------------------------------------------------------ objects

    def objects(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
        return list(self.node_objs.values()), list(self.pods.values()), list(self.nps.values())

    def fresh_index(self) -> ClusterIndex:
        nodes, pods, nps = copy.deepcopy(self.objects())
        return ClusterIndex.from_objects(CAT, nodes, pods, nps)


def reservation_of(pod: dict[str, Any]) -> Reservation | None:
    raw = (pod["metadata"].get("annotations") or {}).get(RESERVATION_ANNOTATION)
    return parse_reservation(raw) if raw else None


def gated_now(pod: dict[str, Any]) -> bool:
    return any(g.get("name") == GATE for g in pod["spec"].get("schedulingGates") or ())


def waiting(pod: dict[str, Any]) -> bool:
    return not pod["spec"].get("nodeName") and pod["status"]["phase"] == "Pending"


# --------------------------------------------------------------------------- generation


def generate(rng: random.Random, counts: Counts, now: float) -> World:
    w = World(rng, counts)
    for k in range(rng.randint(1, 4)):
        model_name = rng.choice(sorted(PRODUCTS))
        model = CAT.model(model_name)
        name = f"n{k + 1}"
        gpus = []
        for i in range(rng.randint(1, 4)):
            g = Gpu(i, unhealthy=rng.random() < 0.08)
            layout = () if rng.random() < 0.15 else rng.choice(LAYOUTS[model_name])
            for pl in layout:
                g.insts.append(Inst(pl.profile.name, pl.start, pl.profile.resource))
            gpus.append(g)
        n = SimNode(name, model, gpus, never_applies=rng.random() < 0.2)
        w.nodes[name] = n
        labels = {
            "gpuslice.io/partitioning": "mig",
            "nvidia.com/gpu.product": PRODUCTS[model_name],
            "nvidia.com/gpu.count": str(len(gpus)),
        }
        w.node_objs[name] = {
            "kind": "Node",
            "metadata": {
                "name": name,
                "uid": f"uid-{name}",
                "labels": labels,
                "resourceVersion": w.next_rv(),
            },
            "spec": {},
            "status": {"allocatable": {}},
        }
        spec_gpus = [
            {"index": g.index, "mig": [{"profile": i.profile, "start": i.start} for i in g.insts]}
            for g in gpus
        ]
        w.nps[name] = {
            "apiVersion": "gpuslice.io/v1alpha1",
            "kind": "NodePartitioning",
            "metadata": {"name": name, "generation": 2, "resourceVersion": w.next_rv()},
            "spec": {"planId": "1", "mode": "mig", "gpus": spec_gpus},
            "status": {
                "observedGeneration": 2,
                "planId": "1",
                "gpus": [],
                "conditions": [{"type": "Applied", "status": "True", "reason": "Applied"}],
            },
        }
        busy = rng.random() < 0.15  # a spec (the same layout, a later plan) not observed yet
        if busy:
            np = w.nps[name]
            np["metadata"]["generation"] = 3
            np["spec"]["planId"] = "4"
        for g in gpus:
            for inst in g.insts:
                roll = rng.random()
                if roll < 0.3 or (g.unhealthy and roll < 0.5):
                    pod = w.new_pod(
                        w.name("r"),
                        {inst.resource: 1},
                        now - 3000,
                        rng.choice((0, 0, 50)),
                        node=name,
                    )
                    inst.pod = f"ns/{pod['metadata']['name']}"
                    inst.shown_used = rng.random() > 0.1  # just bound: not reported yet
                    inst.unhealthy = rng.random() < 0.08  # an XID under a running pod
                elif roll < 0.42:
                    inst.unhealthy = True
                elif roll < 0.5:
                    inst.foreign = True
                elif roll < 0.55:
                    inst.shown_used = True  # its pod just ended: the agent has not seen it
                elif not g.unhealthy and rng.random() < 0.3:
                    promise(w, n, g, inst, now, busy)
        w.render(name)
    for _ in range(rng.choice((1, 1, 2, 3, 5, 8))):  # a short queue drains, a deep one not
        w.gated_pod(now)
    return w


def promise(w: World, n: SimNode, g: Gpu, inst: Inst, now: float, busy: bool) -> None:
    """A pod an earlier step reserved this free healthy instance for (planned or released)."""
    rng = w.rng
    name = w.name("h")
    pod = w.new_pod(name, {inst.resource: 1}, now - 200, rng.choice((0, 0, 100)))
    released = not busy and rng.random() < 0.5
    since = now - rng.choice((1, 30, 100, 290))
    if released:
        r = Reservation(n.name, State.RELEASED, {inst.resource: (g.index,)}, "", since, since + 120)
        patch = release_patch(pod, n.name, {RESERVATION_ANNOTATION: r.to_json()})
        merged = merge_patch(copy.deepcopy(pod), patch)
        pod.clear()
        pod.update(merged)
    else:
        plan = "4" if busy else rng.choice(("", "1"))
        r = Reservation(
            n.name, State.PLANNED, {inst.resource: (g.index,)}, plan, since, since + 300
        )
        pod["metadata"]["annotations"] = {RESERVATION_ANNOTATION: r.to_json()}
    w.counts.add("initial_reservations")


# --------------------------------------------------------------------------- applying actions


@dataclass
class Applied:
    written: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Node -> the spec written this step."""
    reserve_patches: set[str] = field(default_factory=set)


def apply_decision(w: World, d: Decision) -> Applied:
    """Carry out the decision's actions the way the API server would."""
    out = Applied()
    for a in d.actions:
        if isinstance(a, WriteSpec):
            np = w.nps[a.node]
            assert a.resource_version in (None, np["metadata"]["resourceVersion"])
            np["spec"] = a.spec.model_dump(mode="json")
            np["metadata"]["generation"] += 1
            np["metadata"]["resourceVersion"] = w.next_rv()
            out.written[a.node] = np["spec"]
        elif isinstance(a, PatchPod):
            if a.after_spec is not None and a.after_spec not in out.written:
                continue
            old = w.pods[a.pod]
            rv = (a.patch.get("metadata") or {}).get("resourceVersion")
            assert rv is None or rv == old["metadata"]["resourceVersion"], (a, old["metadata"])
            new = merge_patch(copy.deepcopy(old), a.patch)
            validate_pod_update(old, new)
            new["metadata"]["resourceVersion"] = w.next_rv()
            w.pods[a.pod] = new
            if a.purpose == "reserve":
                out.reserve_patches.add(a.pod)
        elif isinstance(a, WriteReservations):
            np = w.nps[a.node]
            np["status"]["reservations"] = [r.model_dump(mode="json") for r in a.reservations]
            np["metadata"]["resourceVersion"] = w.next_rv()
        elif isinstance(a, MarkCooldown):  # a merge patch of one annotation
            np = w.nps[a.node]
            annotations = dict(np["metadata"].get("annotations") or {})
            annotations.pop(COOLDOWN_ANNOTATION, None)
            if a.until is not None:
                annotations[COOLDOWN_ANNOTATION] = cooldown_annotation(a.until, a.reason)
            np["metadata"]["annotations"] = annotations
            np["metadata"]["resourceVersion"] = w.next_rv()
        elif isinstance(a, EvictPod):
            pod = w.pods.get(a.pod)
            if pod is not None and a.resource_version in (None, pod["metadata"]["resourceVersion"]):
                del w.pods[a.pod]
                w.counts.add("evictions")
        elif isinstance(a, SetNodeCondition):
            obj = w.node_objs[a.node]
            conds = [c for c in obj["status"].get("conditions", ()) if c["type"] != "GpusliceReady"]
            conds.append(
                {"type": "GpusliceReady", "status": a.status, "reason": a.reason, "message": ""}
            )
            obj["status"]["conditions"] = conds
            obj["metadata"]["resourceVersion"] = w.next_rv()
        elif isinstance(a, CreatePartitioning | DeletePartitioning) or not isinstance(a, EmitEvent):
            raise AssertionError(f"unexpected {a}")
    return out


# --------------------------------------------------------------------------- the outside world


def agent_applies(w: World, broken: set[tuple[str, str]]) -> None:
    """Busy agents apply their spec (or report Degraded, or never apply).  A refused spec
    breaks the promises made for it (from outside: the controller planned them soundly)."""
    rng = w.rng
    for name, n in w.nodes.items():
        np = w.nps[name]
        parsed = NodePartitioning.model_validate(np)
        if not is_busy(parsed) or n.never_applies or rng.random() < 0.4:
            continue
        want = {g["index"]: g["mig"] for g in np["spec"]["gpus"]}
        degraded = False
        for g in n.gpus:
            desired = [(m["profile"], m["start"]) for m in want.get(g.index, ())]
            have = [(i.profile, i.start) for i in g.insts]
            if sorted(desired) == sorted(have):
                continue
            keep = {
                (i.profile, i.start)
                for i in g.insts
                if i.pod or i.foreign or i.unhealthy or i.shown_used
            }
            if g.unhealthy or not keep <= set(desired) or rng.random() < 0.1:
                degraded = True  # in use, unhealthy, or a MIG error: this GPU stays
                continue
            old = {(i.profile, i.start): i for i in g.insts}
            g.insts = [
                old.get((p, s)) or Inst(p, s, n.model.profile(p).resource) for p, s in desired
            ]
        gen = np["metadata"]["generation"]
        np["status"]["observedGeneration"] = gen
        np["status"]["planId"] = np["spec"]["planId"]
        if degraded:
            w.counts.add("agent_degraded")
            np["status"]["conditions"] = [
                {"type": "Applied", "status": "False", "reason": "Degraded"},
                {"type": "Degraded", "status": "True", "reason": "InUse"},
            ]
        else:
            w.counts.add("agent_applied")
            np["status"]["conditions"] = [
                {"type": "Applied", "status": "True", "reason": "Applied"}
            ]
        np["metadata"]["resourceVersion"] = w.next_rv()
        w.render(name, report=True)
        if degraded:
            free = usable_free(n)
            broken.update((name, r) for r, k in held_units(w, name).items() if k > free[r])


def scheduler_binds(w: World, broken: set[tuple[str, str]], where: str) -> None:
    """kube-scheduler binds released pods where allocatable has room; the kubelet gives each a
    healthy free device it lists (the expected GPU first).  A pod whose promise holds gets a
    usable one (property 1); one whose promise was broken from outside, or that waits for its
    node's new layout (re-planned there), may get none yet, or a foreign one."""
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
        picked: list[Inst] = []
        for res, expected in r.gpus.items():
            options = [
                (not i.usable(g.unhealthy), g.index not in expected, g.index, i.start, i)
                for g in n.gpus
                for i in g.insts
                if i.resource == res and i.pod is None and not (g.unhealthy or i.unhealthy)
            ]
            options.sort(key=lambda o: o[:4])
            good = sum(1 for o in options if not o[0])
            if good < len(expected) and (not holds or (r.node, res) in broken):
                w.counts.add("scheduler_broken")
                if len(options) < len(expected):
                    break  # nothing listed is free: it waits
            else:
                assert good >= len(expected), (
                    f"{where}: {key} released to {r.node} for {dict(r.gpus)}: the kubelet has "
                    f"no healthy free device of {res} for it\n" + describe(w, r.node, w.pods)
                )
            picked += [o[4] for o in options[: len(expected)]]
        if sum(len(g) for g in r.gpus.values()) != len(picked):
            continue
        free_before = usable_free(n)
        for i in picked:
            i.pod = key
        pod["spec"]["nodeName"] = r.node
        pod["status"]["phase"] = "Running"
        pod["metadata"]["resourceVersion"] = w.next_rv()
        w.counts.add("binds")
        w.render(r.node)
        if not holds:
            took_promised(w, r.node, free_before, usable_free(n), broken)


def took_promised(
    w: World,
    node: str,
    before: Counter[str],
    after: Counter[str],
    broken: set[tuple[str, str]],
) -> None:
    """An uncounted pod bound: a released pod whose promise broke and that waits for the spec
    its node applies (re-planned there, ungated: kube-scheduler binds it wherever allocatable
    has room).  It may take a free device another released pod was promised; the promises the
    controller counts there then wait for that spec's new devices, which no controller can
    prevent (both pods are ungated), so the pair counts as broken from outside until the
    promises fit again (:func:`heal`)."""
    w.counts.add("uncounted_binds")
    mark_broken(w, node, before, after, broken)


def mark_broken(
    w: World,
    node: str,
    before: Counter[str],
    after: Counter[str],
    broken: set[tuple[str, str]],
) -> None:
    """Record the (node, resource) pairs whose promises an outside event broke: the usable
    free devices (``before`` and ``after`` it) no longer cover the units held there, and the
    event took some of them."""
    for res, k in held_units(w, node).items():
        if after[res] < k <= before[res] or (after[res] < k and after[res] < before[res]):
            broken.add((node, res))


def outside_events(w: World, now: float, broken: set[tuple[str, str]]) -> None:
    rng = w.rng
    # agents resync their used flags
    for name in w.nodes:
        if rng.random() < 0.5:
            w.render(name, report=True)
    # running pods finish
    running = [k for k, p in sorted(w.pods.items()) if p["spec"].get("nodeName")]
    for key in running:
        if rng.random() < 0.08:
            pod = w.pods.pop(key)
            for g in w.nodes[pod["spec"]["nodeName"]].gpus:
                for i in g.insts:
                    if i.pod == key:
                        i.pod = None
            w.counts.add("finished")
    # devices turn unhealthy or foreign, or recover (not while a spec is applied)
    for name, n in w.nodes.items():
        if is_busy(NodePartitioning.model_validate(w.nps[name])) or rng.random() > 0.25:
            continue
        insts = [(g, i) for g in n.gpus for i in g.insts]
        if not insts:
            continue
        g, i = rng.choice(insts)
        before = usable_free(n), admitted(w, name)
        roll = rng.random()
        if roll < 0.4:
            i.unhealthy = not i.unhealthy
        elif roll < 0.8 and i.pod is None:
            i.foreign = not i.foreign
        elif roll < 0.85:
            g.unhealthy = not g.unhealthy
        mark_health_broken(w, name, before, (usable_free(n), admitted(w, name)), broken)
        w.counts.add("health_events")
        w.render(name, report=True)
    if rng.random() < 0.3:
        w.gated_pod(now)
        w.counts.add("arrivals")


# --------------------------------------------------------------------------- properties


def admitted(w: World, name: str) -> Counter[str]:
    """Units of each resource kube-scheduler admits on node ``name`` beside the bound pods:
    the devices the kubelet lists healthy, less the bound pods' units (a pod on a device that
    turned unhealthy still counts against allocatable); below 0 where those pods count more."""
    listed: Counter[str] = Counter()
    for g in w.nodes[name].gpus:
        for i in g.insts:
            if not (g.unhealthy or i.unhealthy):
                listed[i.resource] += 1
    bound = w.bound_units(name)
    return Counter({r: listed[r] - bound[r] for r in set(listed) | set(bound)})


def promise_capacity(w: World, name: str, free: Counter[str]) -> Counter[str]:
    """What promises on node ``name`` can be kept with: per resource the usable ``free``
    devices, at most what kube-scheduler :func:`admitted`."""
    room = admitted(w, name)
    return Counter({r: min(k, room[r]) for r, k in free.items()})


def mark_health_broken(
    w: World,
    name: str,
    before: tuple[Counter[str], Counter[str]],
    after: tuple[Counter[str], Counter[str]],
    broken: set[tuple[str, str]],
) -> None:
    """:func:`mark_broken` for a health event, on each of what keeps promises (``(usable free,
    admitted)`` before and after it): a device turning unhealthy or foreign takes usable ones,
    and an XID under running pods can cut what kube-scheduler admits alone (seed 130000248 of
    the shares harness: GPU 1 turned unhealthy under two 2g pods, so the two free 2g of GPU 0
    admitted none, and the pod promised both could not bind)."""
    mark_broken(w, name, before[0], after[0], broken)
    mark_broken(w, name, before[1], after[1], broken)


def usable_free(n: SimNode) -> Counter[str]:
    out: Counter[str] = Counter()
    for g in n.gpus:
        for i in g.insts:
            if i.pod is None and i.usable(g.unhealthy):
                out[i.resource] += 1
    return out


def counted(w: World, node: str, pods: dict[str, dict[str, Any]]) -> dict[str, Reservation]:
    """The promises on ``node`` whose slices exist (the ledger's holds): released pods not
    bound, and planned ones while the node applies no spec; not one made for the spec the
    node is applying (a released pod re-planned on its node waits for that spec)."""
    np = w.nps[node]
    busy = is_busy(NodePartitioning.model_validate(np))
    out = {}
    for key, pod in pods.items():
        r = reservation_of(pod)
        if r is None or r.node != node or not waiting(pod) or r.state is State.DRAINING:
            continue
        if busy and (r.state is State.PLANNED or gated_now(pod)):
            continue
        if busy and r.plan and r.plan == np["spec"]["planId"]:
            continue
        out[key] = r
    return out


def held_units(w: World, node: str, pods: dict[str, dict[str, Any]] | None = None) -> Counter[str]:
    out: Counter[str] = Counter()
    for r in counted(w, node, w.pods if pods is None else pods).values():
        out.update(r.units())
    return out


def holders(pods: dict[str, dict[str, Any]]) -> dict[str, Reservation]:
    out = {}
    for key, pod in pods.items():
        r = reservation_of(pod)
        if r is not None and waiting(pod) and r.state is not State.DRAINING:
            out[key] = r
    return out


def check_no_overpromise(
    w: World,
    before: dict[str, Reservation],
    broken: set[tuple[str, str]],
    where: str,
    pods: dict[str, dict[str, Any]] | None = None,
    hidden: Callable[[Any, str], bool] | None = None,
) -> None:
    """Property 1, for the running controller and a restarted one alike (module docstring).
    ``hidden(node, resource)``: a state no controller can tell from the objects (the MPS and
    hybrid test's): the pair counts as broken from outside.
    On a (node, resource) broken from outside, the promises the controller still keeps (its
    view, ``status.reservations``: a released pod whose slice broke is left out while it is
    re-planned on its node) must fit beside any new one."""
    pods = w.pods if pods is None else pods
    for name, n in w.nodes.items():
        view = {e["pod"] for e in w.nps[name]["status"].get("reservations", ())}
        free = usable_free(n)
        after = counted(w, name, pods)
        held = held_units(w, name, pods)
        for res, k in sorted(held.items()):
            if k <= free[res]:
                continue
            if hidden is not None and hidden(n, res):
                w.counts.add("hidden_exempt")
                broken.add((name, res))
                continue
            new = [
                key
                for key, r in after.items()
                if res in r.gpus
                and (key not in before or before[key].node != name or res not in before[key].gpus)
            ]
            kept = sum(
                len(r.gpus[res]) for key, r in after.items() if res in r.gpus and key in view
            )
            if (name, res) in broken and new and kept <= free[res]:
                # KNOWN, kept as a decision: a released pod whose slice broke stays pinned to
                # its node and ungated while it is re-planned there; the controller's own
                # promises (its view) fit beside the new one.  The fast path keeps the free
                # units of its request for it (``_keep_for_pinned``); a plan may still give a
                # free unit to a new pod where the pinned pod's whole request cannot be placed
                # (seed 120000187: it needs two 2g, one turned unhealthy, the plan gave the
                # other to a one-unit pod).  Kubernetes binds a pod all or nothing, so the pinned
                # pod takes that unit only if its whole request frees there (the sick one
                # recovers) before the new pod binds.
                w.counts.add("new_beside_taken")
                continue
            assert (name, res) in broken and not new, (
                f"{where}: node {name} has {free[res]} healthy free {res} but {k} unit(s) are "
                f"promised there (new promises: {new}; broken from outside: "
                f"{(name, res) in broken})\n" + describe(w, name, pods)
            )


def check_new_reservations(
    w: World,
    before: dict[str, Reservation],
    status_before: dict[str, list[dict[str, Any]]],
    applied: Applied,
    where: str,
) -> int:
    made = 0
    for key, r in holders(w.pods).items():
        old = before.get(key)
        same = old is not None and (old.node, dict(old.gpus), old.plan) == (
            r.node,
            dict(r.gpus),
            r.plan,
        )
        if same and old is not None and (r.since == old.since or r.state is not old.state):
            continue  # unchanged, or a planned pod released: the same promise
        made += 1
        status = {g["index"]: g for g in status_before[r.node]}
        spec = applied.written.get(r.node)
        for res, indices in r.gpus.items():
            for gpu, k in Counter(indices).items():
                sg = status.get(gpu)
                sick_gpu = bool(sg and sg.get("unhealthy"))
                bad = {
                    (m["profile"], m["start"])
                    for m in (sg["mig"] if sg else ())
                    if m.get("unhealthy") or m.get("foreign") or sick_gpu
                }
                profile = next(p.name for p in w.nodes[r.node].model.profiles if p.resource == res)
                if r.plan and spec is not None:
                    (sg_spec,) = [g for g in spec["gpus"] if g["index"] == gpu] or [{"mig": []}]
                    places = [
                        (m["profile"], m["start"])
                        for m in sg_spec["mig"]
                        if m["profile"] == profile
                    ]
                else:
                    places = [
                        (m["profile"], m["start"])
                        for m in (sg["mig"] if sg else ())
                        if m["profile"] == profile
                    ]
                good = [p for p in places if p not in bad]
                assert not sick_gpu and len(good) >= k, (
                    f"{where}: {key} reserved {res} on node {r.node} GPU {gpu} ({dict(r.gpus)}, "
                    f"plan {r.plan or '-'}), which has {len(good)} healthy non-foreign such "
                    f"instance(s) (GPU unhealthy: {sick_gpu}; placements {places}; bad {bad})"
                )
    return made


def check_specs_keep(
    w: World, status_before: dict[str, list[dict[str, Any]]], applied: Applied, where: str
) -> None:
    for name, spec in applied.written.items():
        want = {g["index"]: {(m["profile"], m["start"]) for m in g["mig"]} for g in spec["gpus"]}
        for g in status_before[name]:
            for m in g["mig"]:
                if m.get("used") or m.get("unhealthy") or m.get("foreign") or g.get("unhealthy"):
                    assert (m["profile"], m["start"]) in want.get(g["index"], set()), (
                        f"{where}: the spec written for node {name} drops GPU {g['index']}'s "
                        f"{m['profile']}@{m['start']}, which the status reports {m}"
                    )


def describe(w: World, node: str, pods: dict[str, dict[str, Any]]) -> str:
    n = w.nodes[node]
    lines = [
        f"  np: gen {w.nps[node]['metadata']['generation']} {w.nps[node]['status']['conditions']}"
    ]
    for g in n.gpus:
        lines.append(
            f"  GPU {g.index}{' UNHEALTHY' if g.unhealthy else ''}: "
            + ", ".join(
                f"{i.profile}@{i.start}"
                + (f"[{i.pod}]" if i.pod else "")
                + ("!" if i.unhealthy else "")
                + ("F" if i.foreign else "")
                + ("u" if i.shown_used else "")
                for i in g.insts
            )
        )
    for key, pod in sorted(pods.items()):
        r = reservation_of(pod)
        if r is not None and r.node == node:
            lines.append(
                f"  {key}: {r.state.value} {dict(r.gpus)} plan {r.plan or '-'} "
                f"gated {gated_now(pod)} bound {pod['spec'].get('nodeName')}"
            )
    return "\n".join(lines)


# --------------------------------------------------------------------------- one step
# Shared with the MPS/hybrid and DRA harnesses (test_partitioner_promise_soundness_shares.py,
# test_partitioner_promise_soundness_dra.py): each runs its own world through these.


def step_times(rng: random.Random, seed: int, now: float) -> Iterator[tuple[int, float, str]]:
    """A cluster's steps: their number, time and the name a failure gives them."""
    for step in range(rng.randint(*STEPS)):
        now += rng.choice(GAPS)
        yield step, now, f"seed {seed} step {step} (t=T0+{now - T0:.0f})"


@dataclass
class Running:
    """The running controller: its state, carried from step to step, and its index, relisted
    every step as the operator's watches keep it up to date."""

    state: ControllerState = field(default_factory=ControllerState)
    index: ClusterIndex = field(default_factory=lambda: ClusterIndex(CAT))


@dataclass
class Step[W: World]:
    """What :func:`decide_step` did: the reservations and the agents' status before it, the
    running controller's decision and what it changed in the world, and the restarted
    controller's world after its own decision."""

    before: dict[str, Reservation]
    status_before: dict[str, list[dict[str, Any]]]
    d: Decision
    applied: Applied
    restarted: W
    applied_new: Applied


def decide_step[W: World](
    w: W,
    ctl: Running,
    now: float,
    where: str,
    counts: Counts,
    clone: Callable[[Any], Any] = copy.deepcopy,
    claims: list[dict[str, Any]] | None = None,
) -> Step[W]:
    """One step of the running controller ``ctl`` on ``w``, and of the same objects decided
    again.

    Its index is relisted from ``clone`` copies of the objects (``claims`` too, where given);
    4: two decisions on fresh indexes with its state give the same actions; 3: a restarted
    controller (``ControllerState()``, a fresh index) decides on a deep copy of ``w``, its
    actions applied there; then ``ctl`` decides, its actions applied to ``w``, reporting no
    error, and keeps the new state.  Counts what every harness counts of a step; the caller
    makes the checks (1-2, :func:`check_restart_keeps`)."""
    state, index = ctl.state, ctl.index
    nodes, pods, nps = clone(w.objects())
    index.relist("nodes", nodes)
    if claims is not None:
        index.relist("claims", clone(claims))
    index.relist("pods", pods)
    index.relist("partitionings", nps)
    before = holders(w.pods)
    status_before = {name: clone(np["status"]["gpus"]) for name, np in w.nps.items()}

    # 4. determinism: the same objects, state and time
    d1 = decide(state, w.fresh_index(), now, CONFIG)
    d2 = decide(state, w.fresh_index(), now, CONFIG)
    assert d1.actions == d2.actions, f"{where}: two identical steps differ"

    # 3. restart: a fresh controller on the same objects
    restarted = copy.deepcopy(w)
    restarted.rng, restarted.counts = random.Random(0), counts
    d_new = decide(ControllerState(), restarted.fresh_index(), now, CONFIG)
    applied_new = apply_decision(restarted, d_new)
    counts.add("restarts")
    for name, np in w.nps.items():  # ... which keeps the cool-downs recorded on the objects
        if COOLDOWN_ANNOTATION in (np["metadata"].get("annotations") or {}):
            until = state.cooldown.get(name, 0.0)
            if until > now:
                assert d_new.state.cooldown.get(name, 0.0) >= until - 0.001, (
                    f"{where}: after a restart node {name} no longer cools down "
                    f"(the running controller: until {until})"
                )
                counts.add("restart_cooldowns_kept")

    d = decide(state, index, now, CONFIG)
    ctl.state = d.state
    applied = apply_decision(w, d)
    assert not d.error, f"{where}: {d.error}"
    counts.add("steps")
    counts.add("plans", d.plan is not None and bool(d.plan.assignments))
    counts.add("specs_written", len(applied.written))
    counts.add("releases", d.counts.get("releases", 0))
    counts.add("fast_reservations", d.counts.get("fast", 0))
    counts.add(
        "dropped",
        sum(1 for a in d.actions if isinstance(a, PatchPod) and a.purpose == "unreserve"),
    )
    return Step(before, status_before, d, applied, restarted, applied_new)


def check_restart_keeps(w: World, s: Step[Any], where: str, counts: Counts) -> None:
    """3: the restarted controller keeps every reservation the running one keeps, on the same
    node, and makes no second reservation for a pod that holds one."""
    after_old, after_new = holders(w.pods), holders(s.restarted.pods)
    for key, r0 in s.before.items():
        kept = after_old.get(key)
        if kept is None or kept.node != r0.node or key in s.applied.reserve_patches:
            continue  # the running controller dropped it (and maybe reserved it again)
        again = after_new.get(key)
        assert again is not None and again.node == r0.node, (
            f"{where}: after a restart {key}'s reservation on {r0.node} ({r0.state.value}) "
            f"is {again}, the running controller keeps it ({kept.state.value})"
        )
        assert key not in s.applied_new.reserve_patches, (
            f"{where}: after a restart {key}, which holds {dict(r0.gpus)} on {r0.node}, "
            f"is reserved again: {again}"
        )
        counts.add("restart_kept")


def heal(w: World, broken: set[tuple[str, str]], free: Callable[[str], Counter[str]]) -> None:
    """A broken (node, resource) heals once its promises fit again (``free``: a node's usable
    free units per resource, as :func:`promise_capacity` caps them)."""
    for name, res in list(broken):
        if held_units(w, name)[res] <= free(name)[res]:
            broken.discard((name, res))


def run_seeds(
    label: str,
    run: Callable[[int, Counts], None],
    only_seed: str | None,
    base_seed: int,
    clusters: int,
) -> Counts:
    """Run ``clusters`` clusters from ``base_seed`` on (``only_seed`` alone where set) and print
    the counts."""
    counts = Counts()
    seeds = [int(only_seed)] if only_seed else [base_seed + k for k in range(clusters)]
    started = time.monotonic()
    for seed in seeds:
        run(seed, counts)
    elapsed = time.monotonic() - started
    print(f"\n{label}: {len(seeds)} clusters in {elapsed:.1f} s: {dict(sorted(counts.c.items()))}")
    return counts


def assert_exercised(counts: Counts, least: dict[str, int]) -> None:
    c = counts.c
    for key, n in least.items():
        assert c[key] >= n, f"the generator exercised {key} only {c[key]} times (< {n})"


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
            for i in g.insts:
                counts.add("unhealthy_instances", i.unhealthy)
                counts.add("foreign_instances", i.foreign)
                counts.add("lagging_used_flags", i.shown_used != (i.pod is not None))
    broken: set[tuple[str, str]] = set()
    check_no_overpromise(w, holders(w.pods), broken, f"seed {seed} initial")
    ctl = Running()
    for _step, now, where in step_times(rng, seed, start):
        s = decide_step(w, ctl, now, where, counts)
        counts.add("drains", s.d.counts.get("draining", 0))

        # 1-2
        check_no_overpromise(w, s.before, broken, where)
        counts.add(
            "reservations_made",
            check_new_reservations(w, s.before, s.status_before, s.applied, where),
        )
        check_specs_keep(w, s.status_before, s.applied, where)

        check_restart_keeps(w, s, where, counts)
        check_no_overpromise(
            s.restarted,
            s.before,
            set(broken),
            f"{where} (restarted)",
            s.restarted.pods,
        )
        heal(w, broken, lambda name: promise_capacity(w, name, usable_free(w.nodes[name])))

        agent_applies(w, broken)
        scheduler_binds(w, broken, where)
        outside_events(w, now, broken)


def test_promises_stay_sound_on_random_clusters() -> None:
    counts = run_seeds("promise soundness", run_cluster, ONLY_SEED, BASE_SEED, CLUSTERS)
    if ONLY_SEED:
        return
    assert_exercised(
        counts,
        {
            "states": CLUSTERS,
            "steps": 5 * CLUSTERS,
            "restarts": 5 * CLUSTERS,
            "restart_kept": CLUSTERS,
            "restart_cooldowns_kept": CLUSTERS // 4,
            "reservations_made": CLUSTERS,
            "fast_reservations": CLUSTERS // 2,
            "plans": CLUSTERS // 4,
            "specs_written": CLUSTERS // 4,
            "releases": CLUSTERS // 2,
            "binds": CLUSTERS // 4,
            "initial_reservations": CLUSTERS // 2,
            "unhealthy_instances": CLUSTERS // 4,
            "unhealthy_gpus": CLUSTERS // 10,
            "foreign_instances": CLUSTERS // 4,
            "lagging_used_flags": CLUSTERS // 4,
            "health_events": CLUSTERS // 2,
            "dropped": CLUSTERS // 10,
            "agent_applied": CLUSTERS // 10,
            "agent_degraded": CLUSTERS // 25,
            "drains": max(1, CLUSTERS // 100),
        },
    )


# --------------------------------------------------------------------------- regressions
# Each was found by the test above (seed in its docstring); each fails without its fix.

ONE_GPU = {**MIG, "nvidia.com/gpu.count": "1"}


def degraded_np(
    name: str, spec_gpus: list[dict[str, Any]], *gpus: dict[str, Any]
) -> dict[str, Any]:
    """A NodePartitioning whose agent observed the spec (plan 2) and refused it (Degraded)."""
    obj = np_obj(name, plan="2", generation=3, observed=3, applied=False, gpus=list(gpus))
    obj["spec"]["gpus"] = spec_gpus
    obj["status"]["conditions"].append({"type": "Degraded", "status": "True", "reason": "InUse"})
    return obj


def released(name: str, resource: str, node_name: str, gpu: int, since: float) -> dict[str, Any]:
    """A pod released to ``node_name`` for one unit of ``resource`` (not bound yet)."""
    pod = gated(name, resource, created=since - 10)
    r = Reservation(node_name, State.RELEASED, {resource: (gpu,)}, "", since, since + 120)
    return merge_patch(pod, release_patch(pod, node_name, {RESERVATION_ANNOTATION: r.to_json()}))


def test_a_plan_asking_again_for_a_refused_spec_writes_it_and_promises_no_missing_slice() -> None:
    """Seed 20261202.  The agent refused plan 2 (7g on GPU 0; Degraded), GPU 0 is empty.  The
    next plan for a 7g pod makes the same layout: equal to the spec, it was not written, and the
    pod was reserved the 7g "free on the node" that does not exist (dropped at the next step,
    then again every batch)."""
    c = Cluster(
        node("n1", ONE_GPU),
        degraded_np(
            "n1", [{"index": 0, "mig": [{"profile": "7g.80gb", "start": 0}]}], status_gpu(0)
        ),
        gated("p", SEVEN_G),
    )
    c.step(T0)  # opens the window
    d = c.step(T0 + 11)
    (w,) = [a for a in d.actions if isinstance(a, WriteSpec)]
    r = reservation(c, "p")
    assert r is not None and r.plan == w.spec.planId != "2"
    assert [(m.profile, m.start) for m in w.spec.gpus[0].mig] == [("7g.80gb", 0)]


def test_an_unhealthy_instance_shown_used_after_its_pod_left_is_not_offered() -> None:
    """Seed 20261212.  The agent still reports GPU 0's unhealthy 1g used, though its pod has
    gone: counted as neither bound nor unhealthy it was free, and promised (a pod that could
    never bind).  While a pod does run on it, the healthy free 1g beside it is not offered
    either: the kubelet's allocatable lists that one alone, and kube-scheduler counts the pod
    on the unhealthy one against it (``NodeLedger._admits_less``); once that pod has gone it
    is."""
    sick_used = status_gpu(0, ("1g.10gb", 0, True), ("1g.10gb", 1, False))
    sick_used["mig"][0]["unhealthy"] = True
    sick_used["mig"].pop()  # first alone: one unhealthy instance, its pod gone
    c = Cluster(with_alloc(node("n1", ONE_GPU)), applied_np("n1", sick_used), gated("p", ONE_G))
    d = c.step(T0 + 2)
    assert reservation(c, "p") is None and not events(d, "Reserved")
    both = status_gpu(0, ("1g.10gb", 0, True), ("1g.10gb", 1, False))
    both["mig"][0]["unhealthy"] = True  # its pod still runs there
    c = Cluster(
        with_alloc(node("n1", ONE_GPU), **{"1g_10gb": 1}),
        applied_np("n1", both),
        running("xid", "n1", ONE_G),
        gated("p", ONE_G),
    )
    d = c.step(T0 + 2)
    assert reservation(c, "p") is None and not events(d, "Reserved")
    del c.objs[("Pod", "ns/xid")]  # its pod ended (the used flag lags: still shown used)
    c.step(T0 + 4)
    r = reservation(c, "p")
    assert r is not None and dict(r.gpus) == {ONE_G: (0,)}


def test_a_reservation_from_a_slice_the_status_shows_used_names_no_unhealthy_gpu() -> None:
    """Seed 20261212.  GPU 1's only 1g is free (its pod left; the agent still shows it used);
    GPU 0, the busiest, has an unhealthy 1g.  The fast path found no unpinned 1g and expected
    the busiest GPU with one: GPU 0, whose 1g the kubelet never gives."""
    gpu0 = status_gpu(0, ("1g.10gb", 0, False), ("3g.40gb", 4, True))
    gpu0["mig"][0]["unhealthy"] = True
    c = Cluster(
        with_alloc(node("n1", MIG), **{"1g_10gb": 1, "3g_40gb": 1}),
        applied_np("n1", gpu0, status_gpu(1, ("1g.10gb", 0, True))),
        running("big", "n1", "nvidia.com/mig-3g.40gb"),
        gated("p", ONE_G),
    )
    d = c.step(T0 + 2)
    assert events(d, "Reserved") == [
        "reserved nvidia.com/mig-1g.10gb on node n1 GPU 1 (a free slice)"
    ]


def test_a_bound_pod_the_agent_has_not_reported_beside_a_foreign_instance_keeps_its_slice() -> None:
    """Seed 20261275.  Pod "new" was just bound to the 1g at slot 1, which the agent still
    reports free; the 1g at slot 0 is foreign (reported used).  Counting the foreign instance
    as a pod's, the ledger saw no unreported pod, left slot 1 unpinned, and the plan promised
    it to pod p ("slice free on the node")."""
    gpu0 = status_gpu(0, ("1g.10gb", 0, True), ("1g.10gb", 1, False))
    gpu0["mig"][0]["foreign"] = True
    c = Cluster(
        with_alloc(node("n1", ONE_GPU), **{"1g_10gb": 2}),
        applied_np("n1", gpu0),
        running("new", "n1", ONE_G),
        gated("p", ONE_G),
    )
    c.step(T0)  # opens the window
    d = c.step(T0 + 11)
    r = reservation(c, "p")
    assert r is not None and r.plan, r  # a new instance for it, not slot 1
    (w,) = [a for a in d.actions if isinstance(a, WriteSpec)]
    kept = [(m.profile, m.start) for m in w.spec.gpus[0].mig]
    assert ("1g.10gb", 0) in kept and ("1g.10gb", 1) in kept


def test_a_drain_never_freezes_the_gpu_of_a_slice_promised_to_a_released_pod() -> None:
    """Seed 20261748.  GPU 1's free 1g is promised to released pod h; a 7g pod has waited past
    the drain threshold and GPU 1 is the least loaded.  Frozen, GPU 1's devices left the ledger:
    the next step found h's slice "taken by another pod" and the drain planned over it."""
    gpu0 = status_gpu(0, ("4g.40gb", 0, True), ("3g.40gb", 4, True))
    gpu1 = status_gpu(1, ("1g.10gb", 0, False), ("1g.10gb", 1, True))
    c = Cluster(
        with_alloc(node("n1", MIG), **{"1g_10gb": 2, "4g_40gb": 1, "3g_40gb": 1}),
        applied_np("n1", gpu0, gpu1),
        running("a", "n1", "nvidia.com/mig-4g.40gb"),
        running("b", "n1", "nvidia.com/mig-3g.40gb"),
        running("c", "n1", ONE_G),
        released("h", ONE_G, "n1", 1, T0 - 5),
        gated("big", SEVEN_G, created=T0 - 1000),
    )
    seen = []
    for t in (T0, T0 + 11, T0 + 12, T0 + 80):
        d = c.step(t)
        seen += events(d, "Draining") + events(d, "SliceTaken")
    assert seen == [] and reservation(c, "h").state is State.RELEASED
