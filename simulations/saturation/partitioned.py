"""The FGD saturation protocol for partitioned modes (MIG, MPS, hybrid) with repartitioning.

Sampling and metric (as :mod:`simulations.saturation.protocol`, fgd.md §2 and §6)
-----------------------------------------------------------------------
Per seed ``s`` one ``random.Random(s)`` draws, in this order, the arrival list
(:func:`simulations.saturation.protocol.build_arrivals`: the name-sorted originals shuffled, then clones
drawn with replacement until the arrived GPU request reaches 130 % of ``C = 1000 × GPUs``) and
the node rank (:func:`simulations.saturation.protocol.node_ranks`).  Nothing departs.  After every pod
(placed or failed) the event records the arrived request (``num_gpu × gpu_milli``, failed pods
included) and the allocated GPU-milli: the sum of ``num_gpu × gpu_milli`` of the pods placed so
far -- a pod counts its *original* share, not the slice it got.  ``alloc@130`` is the binned
curve of :func:`simulations.saturation.protocol.discrete_curve` at 130 %.  FGD's fragmentation is
measured on MPS rows only, on their milli view (:mod:`simulations.saturation.mps_frag`); MIG and
hybrid rows record zeros.

Cluster mapping (:func:`partitioned_cluster`)
---------------------------------------------
The openb nodes keep their names, CPU, memory and GPU counts; every GPU becomes an
``A100-SXM4-80GB`` of :mod:`planner.catalog` (7 compute slices, 8 memory slots, 80 GiB) in the
row's mode (``mig``, ``mps`` or ``hybrid``).  The openb model (``T4``, ``G2``, ...) stays as the
node's label, so a pod's ``gpu_spec`` still restricts it to the same nodes (``gpuspec10``).
Capacity is unchanged: ``C = 6212 × 1000``.

Pod mapping (:mod:`simulations.inputs.mapping`)
----------------------------------------
MIG rows: ``mig-compute`` (the smallest profile with ``>= gpu_milli × 7 / 1000`` compute slices;
whole-GPU and multi-GPU pods get ``num_gpu`` ``7g.80gb`` instances on one node).  MPS row:
``mps-memory`` (a slice of ``floor(gpu_milli × 79 / 1000)`` GiB, at least 1; whole GPUs 79
GiB).  Hybrid row: ``hybrid-threshold:T`` (shares ``>= T`` and whole GPUs a MIG instance, smaller
shares an MPS slice inside one).  CPU-only pods need no slice: they go, when they arrive, to a
node with enough free CPU and memory chosen by the row's *CPU scheduler* (:class:`CpuScheduler`,
ties to the smallest rank; a CPU-only pod with no such node fails; they count 0 GPU-milli, as
in the FGD protocol):

* ``bestfit`` (the default, as the FGD paper's BestFit): the best BestFit score of fgd.md §4
  over every node, its free-GPU term the node's spare capacity below, in GPU-milli.  No
  kube-scheduler profile can do this: it does not score a resource the pod does not request.
* ``least-allocated``: kube-scheduler's default profile, ``most-allocated``: its bin-packing
  profile (NodeResourcesFit ``MostAllocated``), both with BalancedAllocation, on CPU and memory
  only, over the adaptive share of feasible nodes from a rotating start
  (:mod:`simulations.replay.kube_score`; nodes in the cluster's order).

Arrivals in batches of ``k`` (the planned rows)
-----------------------------------------------
The arrival list is cut into batches of ``k`` consecutive pods.  For each batch:

1. CPU-only pods are placed first (above), in arrival order.
2. **Hosts.**  A node *can host* a GPU pod now if its free CPU and memory cover the pod's, its
   label matches ``gpu_spec``, and repartitioning only FREE capacity could hold the pod's
   slices: on MIG GPUs, some valid layout containing every instance in use holds that many
   more instances of the profile (summed over the node's GPUs); on MPS GPUs,
   ``Σ_g floor(free_g / slice)`` covers the count, ``free_g`` being the usable memory
   (80 GiB − 512 MiB server reserve) minus the slices in use; on hybrid nodes (MPS slices
   inside MIG instances, :mod:`planner.hybrid`) instances in use or hosting a used slice are
   *pinned*, and an MPS slice needs a pinned host with that much memory left or a profile that
   fits beside the pinned instances and offers that much (instance memory − 512 MiB; exact
   for one slice, optimistic for several).  A pod no node can host fails at once, without a
   planner call: the planner could not place it either.
3. **Neighbourhood.**  Each remaining pod lists its hosts by *spare capacity* ascending (the
   planner's own measure, :func:`planner.neighbourhood.spare_capacity`: per MIG GPU the
   largest free aligned block beside the instances in use as a share of the slots, per MPS
   GPU the unused share of usable memory, summed over the node), ties to the smallest rank
   (best fit first).  On MPS nodes a pod asking for slices of one size lists first, up to
   half of ``neighbourhood_gpus`` GPUs, the nodes the planner's MPS polish scores best for it
   (:func:`planner.mps_polish.node_score` with the settings' target, ties by name, the
   snapshot's order): in production the planner sees every node and its polish scores each
   one, so the snapshot must hold the node it would pick, which best fit may rank last (a
   node whose free CPU strands roomy GPUs).  Nodes are taken round-robin over the batch's pods (each pod's first
   host, then each pod's second, ...) while the total stays within ``neighbourhood_gpus``
   GPUs (default 96 = ``PlannerSettings.max_model_gpus``: the planner solves one exact model,
   no internal LNS rounds).  A larger ``neighbourhood_gpus`` hands the planner more hosts
   than one model holds, and the planner's own rounds choose where to pack (a best-fit warm
   start and the packing neighbourhood, :mod:`planner.neighbourhood`), as on a production
   cluster, where the partitioner hands it every plannable node.
4. **Plan.**  :func:`planner.plan` gets a :class:`~planner.snapshot.Snapshot` of exactly those
   nodes: their current instances/slices with used flags, free CPU and memory; the batch's
   remaining pods as :class:`~planner.snapshot.PendingPod` (requests from the mapping, CPU,
   memory, priority 0, ``eligible_nodes`` = the neighbourhood nodes their ``gpu_spec``
   allows).  Settings: ``PlannerSettings(policy=cpsat|greedy)`` with the target workload
   given (the free-capacity level's per-pod CPU and memory, :func:`target_settings`: the lower
   quartile of the trace's GPU pods, as FGD measures fragmentation against the trace's own
   pods), every other field at its default (time limit 1 s).
5. **Apply.**  Every changed GPU gets the planned layout; instances/slices in use must all be
   in it (checked: a plan that moves one raises :class:`PlanViolation`).  Each placed pod
   takes, on each GPU index of its assignment, a free instance of its profile (the one with
   the highest start: the assignment names the GPU, not the instance, and the device plugin
   may hand out any; the highest start keeps slot 0, where ``4g``/``7g`` must start, free
   longest) or a free slice of its size (hybrid: in the instance the assignment's ``hosts``
   names), which become used; its CPU and memory are taken.  On hybrid nodes a whole-instance
   pod never takes an instance that hosts slices, and a used slice must stay in its instance.
   Pods the plan leaves unplaced fail and are dropped.

MIG best static (:func:`run_static`): the layouts of a
:class:`~simulations.replay.static_layouts.StaticPolicy` are set once (all instances free) and never
change; a GPU pod goes to the host with the fewest free instances of its profile (best fit;
ties to the smallest rank), on its lowest-indexed free instances (GPU index, then start).
:func:`best_static_run` runs every candidate of
:func:`simulations.replay.static_layouts.static_candidates` (built-ins plus the mixes matched to the
originals' and to the arrivals' profile demand) and keeps the one with the highest alloc@130:
the best static layout *in hindsight* for that seed.

MIG upper bound (:func:`mig_upper_bound`)
-----------------------------------------
``UB`` = the most GPU-milli that the cluster's GPUs, each given any valid MIG layout, can hold
at once for a subset of the *arrived* GPU pods (each pod on ``num_gpu`` instances of its mapped
profile, on GPUs its ``gpu_spec`` allows), ignoring node boundaries (a multi-GPU pod's
instances may lie on different nodes), CPU and memory, and the arrival order.  Every
allocation any row above reaches under the MIG mapping is such a subset (the final layouts are
valid and each placed pod holds distinct instances), and ``alloc@130 <= final allocation``,
so ``UB`` bounds every MIG row.  Computed with CP-SAT as a pattern program: per GPU label
group ``g`` (the node label; one group unless pods carry ``gpu_spec``) and maximal layout ``L``
(:func:`simulations.replay.static_layouts.maximal_layouts`; every valid layout is contained in one),
``x_{g,L}`` GPUs with ``Σ_L x_{g,L} = GPUs of g``; per pod class ``c`` (profile, instances
``u_c``, value ``v_c = num_gpu × gpu_milli``, allowed groups) and allowed group, ``y_{c,g}``
pods with ``Σ_g y_{c,g} <= n_c`` (class size); per group and profile
``Σ_c u_c y_{c,g} <= Σ_L x_{g,L} count_L(profile)``; maximise ``Σ v_c y_{c,g}``.  The value
reported is CP-SAT's proven bound (equal to the optimum when the status is ``OPTIMAL``; a
valid upper bound either way), as a percentage of capacity.
"""

from __future__ import annotations

import heapq
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np
from ortools.sat.python import cp_model

from planner.catalog import GpuModel, MigProfile, default_catalog
from planner.geometry import Placement, enumerate_layouts
from planner.mig_cpsat import largest_free_block, workload_needs
from planner.mps_polish import NodeMeasure, node_measure, node_score, polish_target
from planner.settings import PlannerSettings, Policy
from planner.snapshot import (
    GpuState,
    MigInstance,
    Mode,
    MpsSlice,
    NodeState,
    PendingPod,
    Plan,
    Snapshot,
    mig_profile_of,
    mps_gb_of,
)
from simulations.inputs.cluster import Cluster, Node
from simulations.inputs.mapping import Mapping as PodMapping
from simulations.inputs.mapping import SliceRequest, make_mapping
from simulations.inputs.workload import GPU_MILLI, Pod, Workload
from simulations.replay.kube_score import Strategy, nodes_to_score, resource_score
from simulations.replay.static_layouts import (
    StaticPolicy,
    assign_static,
    maximal_layouts,
    static_candidates,
)
from simulations.saturation.fragmentation import TargetWorkload
from simulations.saturation.mps_frag import MpsFragTracker
from simulations.saturation.protocol import (
    TARGET_RATIO,
    Progress,
    SaturationResult,
    build_arrivals,
    describe,
    discrete_curve,
    node_ranks,
)

__all__ = [
    "GPU_MODEL",
    "CpuScheduler",
    "PartitionedState",
    "PlanViolation",
    "UpperBound",
    "best_static_run",
    "hybrid_support",
    "mig_upper_bound",
    "partitioned_cluster",
    "run_planned",
    "run_static",
    "upper_bound_run",
]

GPU_MODEL = "A100-SXM4-80GB"
"""Every GPU of a partitioned cluster (module docstring, cluster mapping)."""
DEFAULT_NEIGHBOURHOOD_GPUS = PlannerSettings().max_model_gpus
_MIB_PER_GIB = 1024

PlannerFn = Callable[[Snapshot, PlannerSettings], Plan]
BatchHook = Callable[["PartitionedState"], None]


class CpuScheduler(StrEnum):
    """Who places the CPU-only pods (module docstring, CPU-only pods)."""

    BESTFIT = "bestfit"
    """fgd.md §4 BestFit, which also sees the node's free GPU share (the FGD paper's)."""
    LEAST_ALLOCATED = "least-allocated"
    """kube-scheduler's default profile (NodeResourcesFit LeastAllocated + balanced)."""
    MOST_ALLOCATED = "most-allocated"
    """kube-scheduler with NodeResourcesFit MostAllocated, the bin-packing profile."""


_STRATEGY = {
    CpuScheduler.LEAST_ALLOCATED: Strategy.LEAST_ALLOCATED,
    CpuScheduler.MOST_ALLOCATED: Strategy.MOST_ALLOCATED,
}


class PlanViolation(RuntimeError):
    """A plan moved or dropped an instance/slice in use, or assigned a pod to no free one."""


def partitioned_cluster(cluster: Cluster, mode: Mode, model: str = GPU_MODEL) -> Cluster:
    """The same nodes (names, CPU, memory, GPU counts, labels) with ``model`` GPUs in ``mode``."""
    default_catalog().model(model)  # raise early for an unknown model
    nodes = tuple(
        Node(
            name=n.name,
            cpu_milli=n.cpu_milli,
            memory_mib=n.memory_mib,
            gpus=n.gpus,
            model=n.model,
            mode=mode,
            catalog_model=model if n.gpus else None,
        )
        for n in cluster.nodes
    )
    return Cluster(name=f"{cluster.name}-{mode.value}-{model}", nodes=nodes, source=cluster.source)


# --------------------------------------------------------------------------- MIG geometry cache


class _MigGeometry:
    """Per set of used placements of one GPU: addable instances per profile and spare share."""

    def __init__(self, model: GpuModel) -> None:
        self.model = model
        self.profiles: list[MigProfile] = [p for p in model.profiles if not p.variant]
        self._addable: dict[tuple[tuple[str, int], ...], dict[str, int]] = {}
        self._lfb: dict[int, int] = {}

    def addable(self, used: tuple[tuple[str, int], ...]) -> dict[str, int]:
        """Profile name -> most instances of it that fit beside ``used`` on one GPU."""
        found = self._addable.get(used)
        if found is None:
            pinned = [Placement(s, self.model.profile(p)) for p, s in used]
            base = Counter(p.profile.name for p in pinned)
            found = dict.fromkeys((p.name for p in self.profiles), 0)
            for layout in enumerate_layouts(self.model, pinned=pinned, profiles=self.profiles):
                counts = Counter(p.profile.name for p in layout)
                for name in found:
                    found[name] = max(found[name], counts[name] - base[name])
            self._addable[used] = found
        return found

    def spare(self, used: tuple[tuple[str, int], ...]) -> float:
        pinned = [Placement(s, self.model.profile(p)) for p, s in used]
        return largest_free_block(self.model, pinned, self._lfb) / self.model.memory_slots


# --------------------------------------------------------------------------- cluster state


@dataclass(slots=True)
class SimGpu:
    index: int
    mig: list[MigInstance] = field(default_factory=list)
    mps: list[MpsSlice] = field(default_factory=list)

    def used_key(self) -> tuple[tuple[str, int], ...]:
        """The pinned instances: used, or hosting a used MPS slice (hybrid)."""
        return tuple(sorted((i.profile, i.start) for i in self.mig if _pinned(i)))


def _slices(instance: MigInstance) -> tuple[MpsSlice, ...]:
    """The MPS slices a MIG instance hosts (hybrid nodes; none on planners without hybrid)."""
    return tuple(getattr(instance, "mps", ()))


def _pinned(instance: MigInstance) -> bool:
    return instance.used or any(s.used for s in _slices(instance))


@dataclass(slots=True)
class SimNode:
    name: str
    label: str
    mode: Mode
    rank: int
    cpu_free: int
    mem_free: int
    cpu_total: int
    mem_total: int
    gpus: list[SimGpu]
    addable: dict[str, int] = field(default_factory=dict)
    """MIG: profile -> instances that could be added on the node (free capacity only)."""
    free_mib: list[int] = field(default_factory=list)
    """MPS: per GPU, usable memory minus the slices in use.  Hybrid: per pinned host instance
    (one hosting a used slice), its usable memory minus those slices."""
    host_mib: list[int] = field(default_factory=list)
    """Hybrid: usable MiB of each profile that can still be added beside the pinned instances."""
    spare: float = 0.0


class PartitionedState:
    """Nodes, their GPUs' instances/slices (used or free), CPU and memory; allocated milli."""

    def __init__(
        self,
        cluster: Cluster,
        rank: Sequence[int],
        settings: PlannerSettings,
        cpu_scheduler: CpuScheduler = CpuScheduler.BESTFIT,
    ) -> None:
        models = {n.catalog_model for n in cluster.nodes if n.gpus}
        if len(models) != 1:
            raise ValueError(
                f"a partitioned cluster has one GPU model, got {sorted(map(str, models))}"
            )
        self.model = default_catalog().model(next(iter(models)) or GPU_MODEL)
        self.geometry = _MigGeometry(self.model)
        self.reserve_mib = settings.mps_reserve_mib
        self.usable_mib = max(0, self.model.memory_mib - settings.mps_reserve_mib)
        self.nodes: list[SimNode] = []
        for n, r in zip(cluster.nodes, rank, strict=True):
            node = SimNode(
                n.name,
                n.model,
                n.mode,
                r,
                n.cpu_milli,
                n.memory_mib,
                n.cpu_milli,
                n.memory_mib,
                [SimGpu(i) for i in range(n.gpus)],
            )
            self.nodes.append(node)
            self.refresh(node)
        self.by_name = {n.name: n for n in self.nodes}
        self.max_cpu = max(n.cpu_milli for n in cluster.nodes) or 1
        self.max_gpus = max(n.gpus for n in cluster.nodes) or 1
        self.used_milli = 0
        self.cpu_scheduler = CpuScheduler(cpu_scheduler)
        self._next_start = 0
        self._to_score = nodes_to_score(len(self.nodes))

    def refresh(self, node: SimNode) -> None:
        """Recompute the node's host index and spare capacity after a change."""
        if node.mode is Mode.MPS:
            node.free_mib = [
                self.usable_mib - sum(s.memory_mib for s in g.mps if s.used) for g in node.gpus
            ]
            node.spare = sum(max(0.0, f / self.usable_mib) for f in node.free_mib)
            return
        total: Counter[str] = Counter()
        spare = 0.0
        for g in node.gpus:
            key = g.used_key()
            total.update(self.geometry.addable(key))
            spare += self.geometry.spare(key)
        node.addable = dict(total)
        node.spare = spare
        if node.mode is Mode.HYBRID:
            node.free_mib = [
                self.instance_usable(i.profile) - sum(x.memory_mib for x in _slices(i) if x.used)
                for g in node.gpus
                for i in g.mig
                if not i.used and any(x.used for x in _slices(i))
            ]
            node.host_mib = [self.instance_usable(p) for p, n in node.addable.items() if n > 0]

    def instance_usable(self, profile: str) -> int:
        """MiB a MIG instance of ``profile`` offers to MPS slices (memory minus the reserve)."""
        return max(0, self.model.profile(profile).memory_mib - self.reserve_mib)

    def can_host(self, node: SimNode, pod: Pod, req: SliceRequest) -> bool:
        if node.cpu_free < pod.cpu_milli or node.mem_free < pod.memory_mib:
            return False
        if pod.gpu_spec and node.label not in pod.gpu_spec:
            return False
        if req.kind == "mig":
            if node.mode is Mode.MPS:
                return False
            return node.addable.get(req.profile or "", 0) >= req.count
        need = (req.memory_gb or 0) * _MIB_PER_GIB
        if node.mode is Mode.MIG or req.count > 1:
            # one MPS slice per pod, as production serves them (planner.demand.one_mps_slice)
            return False
        if node.mode is Mode.HYBRID:
            # exact for one slice; for several, optimistic (the planner decides)
            return any(f >= need for f in node.free_mib) or any(u >= need for u in node.host_mib)
        return sum(f // need for f in node.free_mib) >= req.count

    def snapshot_node(self, node: SimNode) -> NodeState:
        return NodeState(
            name=node.name,
            mode=node.mode,
            model=self.model.name,
            gpus=tuple(GpuState(g.index, tuple(g.mig), tuple(g.mps)) for g in node.gpus),
            cpu_milli_free=node.cpu_free,
            memory_mib_free=node.mem_free,
        )

    def utilisation(self) -> dict[str, Any]:
        """Where the capacity went at the end of a run (percent).

        ``slices_used``: compute slices of instances held by pods (whole instances, or hosts
        of a used MPS slice) over all compute slices (MIG, hybrid); MPS: memory of used slices
        over usable memory.  ``fill``: allocated GPU-milli over the milli those slices stand
        for (``1000 / 7`` per compute slice; MPS: per usable-memory share) -- what the
        mapping rounds up is lost there, whatever the packing.
        """
        gpus = sum(len(n.gpus) for n in self.nodes)
        if not gpus:
            return {}
        if any(n.mode is Mode.MPS for n in self.nodes):
            held = sum(s.memory_mib for n in self.nodes for g in n.gpus for s in g.mps if s.used)
            share = held / (self.usable_mib * gpus)
        else:
            held = sum(
                self.model.profile(i.profile).compute
                for n in self.nodes
                for g in n.gpus
                for i in g.mig
                if _pinned(i)
            )
            share = held / (self.model.compute_slices * gpus)
        fill = self.used_milli / (share * gpus * GPU_MILLI) if share else 0.0
        out: dict[str, Any] = {
            "slices_used_pct": round(100 * share, 3),
            "fill_pct": round(100 * fill, 3),
        }
        if not any(n.mode is Mode.MPS for n in self.nodes):
            # GPUs by the largest profile that still fits beside the pinned instances
            largest: Counter[str] = Counter()
            for n in self.nodes:
                for g in n.gpus:
                    add = self.geometry.addable(g.used_key())
                    fits = [p for p in self.geometry.profiles if add.get(p.name, 0) > 0]
                    big = max(fits, key=lambda p: (p.compute, p.memory_slices), default=None)
                    largest[big.shape if big is not None else "none"] += 1
            out["gpus_by_largest_free_profile"] = dict(sorted(largest.items()))
        return out

    def used_instances(self) -> set[tuple[str, int, str, int]]:
        """Every MIG instance in use: (node, GPU index, profile, start)."""
        return {
            (n.name, g.index, i.profile, i.start)
            for n in self.nodes
            for g in n.gpus
            for i in g.mig
            if _pinned(i)
        }

    def used_slices(self) -> Counter[tuple[str, int, int, int]]:
        """Every MPS slice in use: (node, GPU index, host instance start or -1, MiB) -> count."""
        out: Counter[tuple[str, int, int, int]] = Counter()
        for n in self.nodes:
            for g in n.gpus:
                out.update((n.name, g.index, -1, s.memory_mib) for s in g.mps if s.used)
                for i in g.mig:
                    out.update(
                        (n.name, g.index, i.start, s.memory_mib) for s in _slices(i) if s.used
                    )
        return out

    # ------------------------------------------------------------------ CPU-only pods

    def place_cpu_only(self, pod: Pod) -> SimNode | None:
        """Place a CPU-only pod as ``cpu_scheduler`` does (module docstring); the node it went
        to, or ``None`` when no node has the CPU and memory."""
        chosen = (
            self._bestfit_node(pod)
            if self.cpu_scheduler is CpuScheduler.BESTFIT
            else self._kube_node(pod, _STRATEGY[self.cpu_scheduler])
        )
        if chosen is None:
            return None
        chosen.cpu_free -= pod.cpu_milli
        chosen.mem_free -= pod.memory_mib
        return chosen

    def _bestfit_node(self, pod: Pod) -> SimNode | None:
        """fgd.md §4 BestFit (free GPU = spare capacity in milli), ties to the smallest rank."""
        best: tuple[int, int] | None = None
        chosen: SimNode | None = None
        for n in self.nodes:
            if n.cpu_free < pod.cpu_milli or n.mem_free < pod.memory_mib:
                continue
            s = 0.0 + ((n.cpu_free - pod.cpu_milli) / self.max_cpu) * 0.5
            s += ((n.spare * GPU_MILLI) / (self.max_gpus * GPU_MILLI)) * 0.5
            key = (-int((1.0 - s) * 100), n.rank)
            if best is None or key < best:
                best, chosen = key, n
        return chosen

    def credit(self, pod: Pod, slices_mib: Sequence[int] = ()) -> int:
        """The GPU-milli a placed pod counts for in the allocation metric: what it asked
        (``gpu_milli`` of each GPU), but for an MPS slice never more than the slice's share of
        the GPU's usable memory.  ``mps-memory`` maps a share to whole GiB rounding down (so
        shares that fit together still fit), so an 810-milli pod gets 63 GiB, 792 milli of an
        A100-80GB's usable memory: counting 810 credited a GPU with more than it holds (two
        pods of 550 and 460 made one GPU 101 % allocated)."""
        if not slices_mib or not self.usable_mib:
            return pod.total_gpu_milli
        per_slice = [min(pod.gpu_milli, mib * GPU_MILLI // self.usable_mib) for mib in slices_mib]
        return min(pod.total_gpu_milli, sum(per_slice))

    def _kube_node(self, pod: Pod, strategy: Strategy) -> SimNode | None:
        """kube-scheduler's cycle (:mod:`simulations.replay.kube_score`): feasible nodes
        collected from where the last cycle stopped until enough are found, scored on CPU and
        memory, ties to the first found (kube-scheduler keeps no fixed node order to break ties
        by, shared/facts/k8s-scheduling.md section 5: a fixed rank packed better than it
        does)."""
        total = len(self.nodes)
        found: list[SimNode] = []
        processed = 0
        while processed < total and len(found) < self._to_score:
            n = self.nodes[(self._next_start + processed) % total]
            processed += 1
            if n.cpu_free >= pod.cpu_milli and n.mem_free >= pod.memory_mib:
                found.append(n)
        self._next_start = (self._next_start + processed) % total if total else 0
        best: tuple[int, int] | None = None
        chosen: SimNode | None = None
        for n in found:
            score = resource_score(
                n.cpu_total,
                n.mem_total,
                n.cpu_total - n.cpu_free,
                n.mem_total - n.mem_free,
                pod.cpu_milli,
                pod.memory_mib,
                strategy,
            )
            if best is None or -score < best[0]:
                best, chosen = (-score, 0), n
        return chosen

    # ------------------------------------------------------------------ applying a plan

    def apply(self, plan: Plan, pods: Mapping[str, tuple[Pod, SliceRequest]]) -> list[str]:
        """Apply ``plan`` (module docstring, step 5); return the names of the placed pods."""
        touched: set[str] = set()
        for (node_name, index), planned in plan.layouts.items():
            node = self.by_name[node_name]
            gpu = node.gpus[index]
            touched.add(node_name)
            if node.mode is Mode.MPS:
                self._apply_mps(
                    node, gpu, [(s.memory_mib, s.thread_percentage) for s in planned.mps]
                )
            else:
                new = [(self.model.profile(p).name, s) for p, s in planned.mig]
                hosted = {
                    start: [(x.memory_mib, x.thread_percentage) for x in slices]
                    for start, slices in getattr(planned, "mig_mps", ())
                }
                self._apply_mig(node, gpu, new, hosted)
        placed: list[str] = []
        for name, asg in plan.assignments.items():
            pod, _req = pods[name]
            node = self.by_name[asg.node]
            hosts: Mapping[str, tuple[int, ...]] = getattr(asg, "hosts", {}) or {}
            for resource, indices in asg.gpus.items():
                starts = hosts.get(resource)
                for k, index in enumerate(indices):
                    host = starts[k] if starts is not None else None
                    self._take(node, node.gpus[index], resource, name, host)
            node.cpu_free -= pod.cpu_milli
            node.mem_free -= pod.memory_mib
            if node.cpu_free < 0 or node.mem_free < 0:
                raise PlanViolation(f"pod {name}: node {node.name} CPU/memory overcommitted")
            self.used_milli += self.credit(
                pod,
                [
                    gb * 1024
                    for resource, indices in asg.gpus.items()
                    if (gb := mps_gb_of(resource))
                    for _ in indices
                ],
            )
            touched.add(node.name)
            placed.append(name)
        for node_name in touched:
            self.refresh(self.by_name[node_name])
        return placed

    def _apply_mig(
        self,
        node: SimNode,
        gpu: SimGpu,
        new: list[tuple[str, int]],
        hosted: Mapping[int, list[tuple[int, int | None]]],
    ) -> None:
        old = {(i.profile, i.start): i for i in gpu.mig}
        pinned = {key for key, i in old.items() if _pinned(i)}
        missing = pinned - set(new)
        if missing:
            raise PlanViolation(
                f"node {node.name} GPU {gpu.index}: the plan drops used instances {sorted(missing)}"
            )
        out: list[MigInstance] = []
        for p, start in sorted(new, key=lambda x: x[1]):
            before = old.get((p, start))
            used = before is not None and before.used
            slices = hosted.get(start)
            if slices is None:
                if before is not None and any(x.used for x in _slices(before)):
                    raise PlanViolation(
                        f"node {node.name} GPU {gpu.index}: the plan drops the used MPS slices "
                        f"of {p}@{start}"
                    )
                out.append(MigInstance(p, start, used))
                continue
            if used:
                raise PlanViolation(
                    f"node {node.name} GPU {gpu.index}: the plan puts MPS slices in the used "
                    f"instance {p}@{start}"
                )
            kept = _keep_used(
                _slices(before) if before is not None else (),
                slices,
                f"node {node.name} GPU {gpu.index} instance {p}@{start}",
            )
            if sum(x.memory_mib for x in kept) > self.instance_usable(p):
                raise PlanViolation(
                    f"node {node.name} GPU {gpu.index}: slices exceed {p}@{start}'s memory"
                )
            out.append(MigInstance(p, start, False, mps=tuple(kept)))  # type: ignore[call-arg]
        gpu.mig = out

    def _apply_mps(self, node: SimNode, gpu: SimGpu, new: list[tuple[int, int]]) -> None:
        gpu.mps = _keep_used(gpu.mps, new, f"node {node.name} GPU {gpu.index}")

    def _take(
        self, node: SimNode, gpu: SimGpu, resource: str, pod: str, host: int | None = None
    ) -> None:
        profile = mig_profile_of(resource)
        if profile is not None:
            name = self.model.profile(profile).name
            free = [
                k
                for k, i in enumerate(gpu.mig)
                if not i.used and i.profile == name and not _slices(i)
            ]
            if not free:
                raise PlanViolation(
                    f"pod {pod}: no free {name} on node {node.name} GPU {gpu.index}"
                )
            k = max(free, key=lambda j: gpu.mig[j].start)
            gpu.mig[k] = MigInstance(name, gpu.mig[k].start, True)
            return
        gb = mps_gb_of(resource)
        mib = (gb or 0) * _MIB_PER_GIB
        if node.mode is Mode.HYBRID:
            at = [k for k, i in enumerate(gpu.mig) if i.start == host and not i.used]
            if not at:
                raise PlanViolation(
                    f"pod {pod}: no free host instance at {host} on node {node.name} "
                    f"GPU {gpu.index}"
                )
            inst = gpu.mig[at[0]]
            slices = list(_slices(inst))
            free = [k for k, x in enumerate(slices) if not x.used and x.memory_mib == mib]
            if not free:
                raise PlanViolation(
                    f"pod {pod}: no free {resource} slice in {inst.profile}@{inst.start} on "
                    f"node {node.name} GPU {gpu.index}"
                )
            x = slices[free[0]]
            slices[free[0]] = MpsSlice(x.memory_mib, True, x.thread_percentage)
            gpu.mig[at[0]] = MigInstance(inst.profile, inst.start, False, mps=tuple(slices))  # type: ignore[call-arg]
            return
        free = [k for k, s in enumerate(gpu.mps) if not s.used and s.memory_mib == mib]
        if not free:
            raise PlanViolation(
                f"pod {pod}: no free {resource} slice on node {node.name} GPU {gpu.index}"
            )
        s = gpu.mps[free[0]]
        gpu.mps[free[0]] = MpsSlice(s.memory_mib, True, s.thread_percentage)


def _keep_used(
    before: Iterable[MpsSlice], new: Iterable[tuple[int, int | None]], where: str
) -> list[MpsSlice]:
    """The planned slices, the used ones of ``before`` marked used; every used one must stay."""
    left = Counter(s.memory_mib for s in before if s.used)
    out: list[MpsSlice] = []
    for mib, threads in new:
        is_used = left[mib] > 0
        if is_used:
            left[mib] -= 1
        out.append(MpsSlice(mib, is_used, threads))
    if +left:
        raise PlanViolation(f"{where}: the plan drops used slices {dict(+left)}")
    return out


# --------------------------------------------------------------------------- planned rows


def _polish_measure(settings: PlannerSettings, usable_mib: int) -> NodeMeasure | None:
    """The planner's polish measure of ``settings``' target on GPUs of ``usable_mib``, or
    ``None`` when the polish is off or has no target shape given (then it learns one per
    snapshot)."""
    if not settings.mps_polish:
        return None
    shapes = polish_target(Snapshot(nodes=(), pods=()), settings)
    return node_measure(shapes, usable_mib) if shapes else None


def _hosts(
    cand: Sequence[SimNode],
    pod: Pod,
    req: SliceRequest,
    cap_gpus: int,
    polish: NodeMeasure | None,
) -> list[SimNode]:
    """A pod's host list (module docstring, step 3): on MPS nodes, for slices of one size, the
    nodes the planner's polish scores best for it (its score, then name: the snapshot's
    order) up to half of ``cap_gpus``, then best fit (spare capacity, then rank)."""
    best_fit = heapq.nsmallest(cap_gpus, cand, key=lambda n: (n.spare, n.rank))
    if polish is None or req.kind != "mps" or req.count < 1 or req.memory_gb is None:
        return best_fit
    mib = req.memory_gb * _MIB_PER_GIB
    scored: list[tuple[int, str, SimNode]] = []
    for n in cand:
        frees = [polish.usable - sum(x.memory_mib for x in g.mps) for g in n.gpus]
        got = node_score(polish, n.cpu_free, frees, pod.cpu_milli, mib, req.count)
        if got is not None:
            scored.append((-got[0], n.name, n))
    out: list[SimNode] = []
    seen: set[str] = set()
    total = 0
    for _, name, n in heapq.nsmallest(cap_gpus, scored, key=lambda t: (t[0], t[1])):
        if total + len(n.gpus) > cap_gpus // 2:
            break
        out.append(n)
        seen.add(name)
        total += len(n.gpus)
    out.extend(n for n in best_fit if n.name not in seen)
    return out


def _neighbourhood(hosts: Sequence[Sequence[SimNode]], cap_gpus: int) -> list[SimNode]:
    """Round-robin over the pods' host lists while the GPUs stay within ``cap_gpus``."""
    chosen: dict[str, SimNode] = {}
    total = 0
    depth = 0
    longest = max((len(h) for h in hosts), default=0)
    while depth < longest and total < cap_gpus:
        for h in hosts:
            if depth < len(h):
                n = h[depth]
                if n.name not in chosen and total + len(n.gpus) <= cap_gpus:
                    chosen[n.name] = n
                    total += len(n.gpus)
        depth += 1
    return list(chosen.values())


@dataclass(slots=True)
class _Recorder:
    n: int
    arrived: np.ndarray = field(init=False)
    used: np.ndarray = field(init=False)
    ok: np.ndarray = field(init=False)
    """Per event: the pod was placed."""
    frag: np.ndarray = field(init=False)
    """Per event: the cluster's FGD fragmentation (milli-GPU; zeros where none is measured)."""
    idle: np.ndarray = field(init=False)
    """Per event: the free milli-GPU that fragmentation is measured on (NaN: capacity minus
    the allocated milli)."""
    event: int = 0
    total_arrived: int = 0
    placed: int = 0
    failed_milli: int = 0

    def __post_init__(self) -> None:
        self.arrived = np.zeros(self.n, dtype=np.int64)
        self.used = np.zeros(self.n, dtype=np.int64)
        self.frag = np.zeros(self.n, dtype=np.float64)
        self.idle = np.full(self.n, np.nan, dtype=np.float64)
        self.ok = np.zeros(self.n, dtype=np.bool_)

    def record(
        self, pod: Pod, ok: bool, used_milli: int, frag: float = 0.0, idle: float | None = None
    ) -> None:
        self.ok[self.event] = ok
        self.frag[self.event] = frag
        if idle is not None:
            self.idle[self.event] = idle
        if ok:
            self.placed += 1
        else:
            self.failed_milli += pod.total_gpu_milli
        self.total_arrived += pod.total_gpu_milli
        self.arrived[self.event] = self.total_arrived
        self.used[self.event] = used_milli
        self.event += 1


def _result(
    label: str,
    seed: int,
    batch: int,
    cluster: Cluster,
    workload: Workload,
    rec: _Recorder,
    started: float,
    extra: dict[str, Any],
) -> SaturationResult:
    frag = rec.frag
    return SaturationResult(
        policy=label,
        seed=seed,
        batch=batch,
        cluster=cluster.name,
        workload=workload.name,
        total_gpus=cluster.total_gpus,
        pods=rec.n,
        placed=rec.placed,
        failed=rec.n - rec.placed,
        failed_gpu_milli=rec.failed_milli,
        arrived=rec.arrived,
        used=rec.used,
        frag=frag,
        curve=discrete_curve(
            rec.arrived,
            rec.used,
            frag,
            cluster.total_gpus,
            idle=None if np.isnan(rec.idle).any() else rec.idle,
        ),
        runtime_s=time.perf_counter() - started,
        extra={**extra, "placed_flags": rec.ok},
    )


def _default_planner(snapshot: Snapshot, settings: PlannerSettings) -> Plan:
    from planner.api import plan

    return plan(snapshot, settings)


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    return float(np.percentile(np.asarray(values), q))


def _seeded(
    cluster: Cluster,
    mode: Mode,
    workload: Workload,
    seed: int,
    target: float,
    settings: PlannerSettings,
    arrivals: Sequence[Pod] | None,
    cpu_scheduler: CpuScheduler = CpuScheduler.BESTFIT,
) -> tuple[Cluster, PartitionedState, list[Pod]]:
    """The partitioned cluster, its empty state and the arrivals of one seed: the arrivals
    drawn from ``seed`` (unless given), then the node rank from the same generator."""
    part = partitioned_cluster(cluster, mode)
    rng = random.Random(seed)
    drawn = (
        list(arrivals)
        if arrivals is not None
        else build_arrivals(
            workload.pods, part.total_gpus * GPU_MILLI, rng, target, workload=describe(workload)
        )
    )
    return part, PartitionedState(part, node_ranks(part, rng), settings, cpu_scheduler), drawn


def target_settings(
    workload: Workload, policy: Policy, mapper: PodMapping | None = None
) -> PlannerSettings:
    """The planner's settings for ``policy`` with the target workload given: the per-pod CPU
    and memory of :func:`planner.mig_cpsat.workload_needs` over ``workload``'s GPU pods, and
    (with ``mapper``) the MPS slice sizes those pods map to, one count per slice
    (``free_capacity_mps_sizes``), and their shapes, one count per pod
    (``free_capacity_mps_shapes``: CPU, slice, slices; FGD's target workload, its pods'
    shapes and frequencies)."""
    gpu_pods = [p for p in workload.pods if p.num_gpu or p.slices]
    cpu, mem = workload_needs((p.cpu_milli, p.memory_mib) for p in gpu_pods)
    sizes: Counter[int] = Counter()
    shapes: Counter[tuple[int, int, int]] = Counter()
    if mapper is not None:
        for p in gpu_pods:
            req = mapper.map(p)
            if req is not None and req.kind == "mps" and req.memory_gb is not None:
                sizes[req.memory_gb * 1024] += req.count
                shapes[(p.cpu_milli, req.memory_gb * 1024, req.count)] += 1
    return PlannerSettings(
        policy=policy,
        free_capacity_cpu_milli=cpu,
        free_capacity_memory_mib=mem,
        free_capacity_mps_sizes=tuple((mib, float(n)) for mib, n in sorted(sizes.items())),
        free_capacity_mps_shapes=tuple(
            (c, mib, k, float(n)) for (c, mib, k), n in sorted(shapes.items())
        ),
    )


def run_planned(
    cluster: Cluster,
    workload: Workload,
    mode: Mode,
    mapping: str,
    seed: int,
    *,
    policy: Policy = Policy.CPSAT,
    batch: int = 1,
    neighbourhood_gpus: int = DEFAULT_NEIGHBOURHOOD_GPUS,
    settings: PlannerSettings | None = None,
    target: float = TARGET_RATIO,
    label: str | None = None,
    planner: PlannerFn | None = None,
    on_batch: BatchHook | None = None,
    arrivals: Sequence[Pod] | None = None,
    progress: Progress | None = None,
    cpu_scheduler: CpuScheduler = CpuScheduler.BESTFIT,
) -> SaturationResult:
    """One seed of a planned row (module docstring): ``cluster`` is the *openb-like* cluster;
    its GPUs are mapped to :data:`GPU_MODEL` in ``mode``; ``cpu_scheduler`` places the
    CPU-only pods.

    ``arrivals`` replays that list instead of drawing one (the node rank is still drawn from
    ``seed``); ``planner`` replaces :func:`planner.plan` (tests); ``on_batch`` is called with
    the state after every batch; ``progress(done, total)`` every few hundred pods.  On MPS
    nodes the result carries FGD's fragmentation of the milli view
    (:class:`simulations.saturation.mps_frag.MpsFragTracker`); other modes record none."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if neighbourhood_gpus < 1:
        raise ValueError(f"neighbourhood_gpus must be >= 1, got {neighbourhood_gpus}")
    started = time.perf_counter()
    # the state needs only the MPS reserve, the same in the default and the target settings;
    # the target (CPU, memory, slice sizes) needs the mapper, which needs the state's model
    base = settings if settings is not None else PlannerSettings(policy=policy)
    part, state, arrivals = _seeded(
        cluster, mode, workload, seed, target, base, arrivals, cpu_scheduler
    )
    mapper: PodMapping = make_mapping(mapping, state.model, base.mps_reserve_mib)
    st = settings if settings is not None else target_settings(workload, policy, mapper)
    plan_fn = planner if planner is not None else _default_planner
    polish = _polish_measure(st, state.usable_mib) if mode is Mode.MPS else None
    rec = _Recorder(len(arrivals))
    frag = (
        MpsFragTracker(state, TargetWorkload.from_pods(workload.pods)) if mode is Mode.MPS else None
    )
    plan_s: list[float] = []
    statuses: Counter[str] = Counter()
    prefiltered = 0
    step = max(1, len(arrivals) // 200)
    for start in range(0, len(arrivals), batch):
        chunk = arrivals[start : start + batch]
        outcome: dict[int, bool] = {}
        pending: dict[str, tuple[Pod, SliceRequest]] = {}
        hosts: list[list[SimNode]] = []
        keys: dict[str, int] = {}
        changed: set[str] = set()
        for j, pod in enumerate(chunk):
            req = mapper.map(pod)
            if req is None:
                went = state.place_cpu_only(pod)
                outcome[j] = went is not None
                if went is not None:
                    changed.add(went.name)
                continue
            cand = [n for n in state.nodes if state.can_host(n, pod, req)]
            if not cand:
                outcome[j] = False
                prefiltered += 1
                continue
            name = f"{start + j}/{pod.name}"
            pending[name] = (pod, req)
            keys[name] = j
            hosts.append(_hosts(cand, pod, req, neighbourhood_gpus, polish))
        if pending:
            nb = _neighbourhood(hosts, neighbourhood_gpus)
            snap = Snapshot(
                nodes=tuple(state.snapshot_node(n) for n in sorted(nb, key=lambda n: n.name)),
                pods=tuple(
                    PendingPod(
                        name=name,
                        requests=req.as_requests(),
                        cpu_milli=pod.cpu_milli,
                        memory_mib=pod.memory_mib,
                        eligible_nodes=(
                            frozenset(n.name for n in nb if n.label in pod.gpu_spec)
                            if pod.gpu_spec
                            else None
                        ),
                    )
                    for name, (pod, req) in pending.items()
                ),
            )
            t0 = time.perf_counter()
            result = plan_fn(snap, st)
            plan_s.append(time.perf_counter() - t0)
            statuses[result.status or result.policy] += 1
            for name in state.apply(result, pending):
                outcome[keys[name]] = True
            for name in pending:
                outcome.setdefault(keys[name], False)
            changed.update(n for n, _ in result.layouts)
            changed.update(a.node for a in result.assignments.values())
        if frag is not None:
            frag.update(state.by_name[n] for n in changed)
        for j, pod in enumerate(chunk):
            if frag is None:
                rec.record(pod, outcome[j], state.used_milli)
            else:
                rec.record(pod, outcome[j], state.used_milli, frag.total, frag.idle)
            if progress is not None and rec.event % step == 0:
                progress(rec.event, rec.n)
        if on_batch is not None:
            on_batch(state)
    if progress is not None:
        progress(rec.n, rec.n)
    extra = {
        "mode": mode.value,
        "mapping": mapping,
        "cpu_scheduler": state.cpu_scheduler.value,
        "planner_policy": st.policy.value,
        "neighbourhood_gpus": neighbourhood_gpus,
        "planner_calls": len(plan_s),
        "planner_s_total": round(sum(plan_s), 3),
        "planner_s_p50": _percentile(plan_s, 50),
        "planner_s_p95": _percentile(plan_s, 95),
        "planner_status": dict(statuses),
        "prefiltered_failures": prefiltered,
        **state.utilisation(),
        "plan_s_list": plan_s,
    }
    return _result(
        label or f"{mode.value}-{st.policy.value}", seed, batch, part, workload, rec, started, extra
    )


# --------------------------------------------------------------------------- static rows


def run_static(
    cluster: Cluster,
    workload: Workload,
    static: StaticPolicy,
    seed: int,
    *,
    mapping: str = "mig-compute",
    target: float = TARGET_RATIO,
    label: str | None = None,
    on_batch: BatchHook | None = None,
    arrivals: Sequence[Pod] | None = None,
) -> SaturationResult:
    """One seed with fixed layouts ``static`` (module docstring, MIG best static).

    ``arrivals`` and ``on_batch`` (called after every pod) as in :func:`run_planned`."""
    started = time.perf_counter()
    part, state, arrivals = _seeded(
        cluster, Mode.MIG, workload, seed, target, PlannerSettings(), arrivals
    )
    mapper = make_mapping(mapping, state.model)
    gpus = [(n.name, g.index, state.model) for n in state.nodes for g in n.gpus]
    for planned in assign_static(static, gpus):
        node = state.by_name[planned.node]
        node.gpus[planned.index].mig = [MigInstance(p, s) for p, s in planned.mig]
    free: dict[str, Counter[str]] = {
        n.name: Counter(i.profile for g in n.gpus for i in g.mig) for n in state.nodes
    }
    rec = _Recorder(len(arrivals))
    for pod in arrivals:
        req = mapper.map(pod)
        ok = False
        if req is None:
            ok = state.place_cpu_only(pod) is not None
        else:
            profile = req.profile or ""
            best: SimNode | None = None
            for n in state.nodes:
                if (
                    free[n.name][profile] >= req.count
                    and n.cpu_free >= pod.cpu_milli
                    and n.mem_free >= pod.memory_mib
                    and (not pod.gpu_spec or n.label in pod.gpu_spec)
                    and (
                        best is None
                        or (free[n.name][profile], n.rank) < (free[best.name][profile], best.rank)
                    )
                ):
                    best = n
            if best is not None:
                left = req.count
                for g in best.gpus:
                    for k, inst in enumerate(g.mig):
                        if left and not inst.used and inst.profile == profile:
                            g.mig[k] = MigInstance(inst.profile, inst.start, True)
                            left -= 1
                free[best.name][profile] -= req.count
                best.cpu_free -= pod.cpu_milli
                best.mem_free -= pod.memory_mib
                state.used_milli += pod.total_gpu_milli
                ok = True
        rec.record(pod, ok, state.used_milli)
        if on_batch is not None:
            on_batch(state)
    extra = {
        "static": static.name,
        "layouts": static.describe(),
        "mapping": mapping,
        **state.utilisation(),
    }
    return _result(
        label or f"mig-static:{static.name}", seed, 1, part, workload, rec, started, extra
    )


def profile_demand(
    pods: Iterable[Pod], model: GpuModel, mapping: str = "mig-compute"
) -> Counter[str]:
    """Instances per profile *shape* the GPU pods of ``pods`` ask for under ``mapping``."""
    mapper = make_mapping(mapping, model)
    out: Counter[str] = Counter()
    for p in pods:
        req = mapper.map(p)
        if req is not None and req.profile is not None:
            out[model.profile(req.profile).shape] += req.count
    return out


def best_static_run(
    cluster: Cluster,
    workload: Workload,
    seed: int,
    *,
    mapping: str = "mig-compute",
    target: float = TARGET_RATIO,
) -> SaturationResult:
    """The best (highest alloc@130) candidate static policy for this seed (module docstring)."""
    model = default_catalog().model(GPU_MODEL)
    rng = random.Random(seed)
    arrivals = build_arrivals(
        workload.pods, cluster.total_gpus * GPU_MILLI, rng, target, workload=describe(workload)
    )
    candidates = static_candidates(
        model,
        cluster.total_gpus,
        profile_demand(workload.pods, model, mapping),
        profile_demand(arrivals, model, mapping),
    )
    started = time.perf_counter()
    runs = [
        run_static(cluster, workload, c, seed, mapping=mapping, target=target, label="mig-static")
        for c in candidates
    ]
    best = max(runs, key=lambda r: (r.at("alloc", 130) or 0.0, r.final_alloc_pct))
    best.extra["candidates"] = {str(r.extra["static"]): r.at("alloc", 130) for r in runs}
    best.runtime_s = time.perf_counter() - started
    return best


# --------------------------------------------------------------------------- upper bound


@dataclass(frozen=True, slots=True)
class UpperBound:
    milli: int
    """Proven bound on the GPU-milli any valid layouts can hold (module docstring)."""
    percent: float
    """``100 × milli / capacity``."""
    optimal: bool
    objective: int
    """The best solution CP-SAT found (``== milli`` when optimal)."""
    runtime_s: float


def mig_upper_bound(
    cluster: Cluster,
    pods: Sequence[Pod],
    *,
    mapping: str = "mig-compute",
    time_limit_s: float = 20.0,
) -> UpperBound:
    """``UB`` for the GPU pods of ``pods`` on ``cluster`` (module docstring)."""
    started = time.perf_counter()
    model = default_catalog().model(GPU_MODEL)
    mapper = make_mapping(mapping, model)
    groups: Counter[str] = Counter()
    for n in cluster.nodes:
        if n.gpus:
            groups[n.model] += n.gpus
    layouts = maximal_layouts(model)
    classes: Counter[tuple[str, int, int, tuple[str, ...]]] = Counter()
    for p in pods:
        req = mapper.map(p)
        if req is None or req.profile is None:
            continue
        allowed = tuple(sorted(g for g in groups if p.allows_model(g)))
        if allowed:
            classes[(model.profile(req.profile).shape, req.count, p.total_gpu_milli, allowed)] += 1
    capacity = cluster.total_gpus * GPU_MILLI
    if not classes:
        return UpperBound(0, 0.0, True, 0, time.perf_counter() - started)
    m = cp_model.CpModel()
    x = {
        (g, i): m.new_int_var(0, count, f"x_{g}_{i}")
        for g, count in groups.items()
        for i in range(len(layouts))
    }
    for g, count in groups.items():
        m.add(sum(x[g, i] for i in range(len(layouts))) == count)
    y: dict[tuple[int, str], cp_model.IntVar] = {}
    keys = sorted(classes)
    for c, key in enumerate(keys):
        allowed = key[3]
        for g in allowed:
            y[c, g] = m.new_int_var(0, classes[keys[c]], f"y_{c}_{g}")
        m.add(sum(y[c, g] for g in allowed) <= classes[keys[c]])
    shapes = sorted({k[0] for k in keys})
    for g in groups:
        for shape in shapes:
            demand = [
                keys[c][1] * y[c, g]
                for c in range(len(keys))
                if keys[c][0] == shape and (c, g) in y
            ]
            if not demand:
                continue
            supply = sum(
                x[g, i] * sum(1 for s, _ in lay if s == shape) for i, lay in enumerate(layouts)
            )
            m.add(sum(demand) <= supply)
    m.maximize(sum(keys[c][2] * v for (c, _g), v in y.items()))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.random_seed = 0
    status = solver.solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise RuntimeError(f"MIG upper bound: CP-SAT status {solver.status_name(status)}")
    bound = int(np.floor(solver.best_objective_bound + 1e-6))
    return UpperBound(
        milli=bound,
        percent=100.0 * bound / capacity,
        optimal=status == cp_model.OPTIMAL,
        objective=round(solver.objective_value),
        runtime_s=time.perf_counter() - started,
    )


def upper_bound_run(
    cluster: Cluster,
    workload: Workload,
    seed: int,
    *,
    mapping: str = "mig-compute",
    target: float = TARGET_RATIO,
) -> dict[str, Any]:
    """``UB`` for one seed's arrivals (the same draws as every row)."""
    rng = random.Random(seed)
    arrivals = build_arrivals(
        workload.pods, cluster.total_gpus * GPU_MILLI, rng, target, workload=describe(workload)
    )
    ub = mig_upper_bound(cluster, arrivals, mapping=mapping)
    return {
        "seed": seed,
        "alloc@130": round(ub.percent, 4),
        "milli": ub.milli,
        "optimal": ub.optimal,
        "runtime_s": round(ub.runtime_s, 3),
    }


# --------------------------------------------------------------------------- hybrid


def hybrid_support(planner: PlannerFn | None = None) -> tuple[bool, str]:
    """Whether :func:`planner.plan` places an MPS request on a ``hybrid`` node.

    Probe: one hybrid A100-80GB node with one empty GPU and one pending ``nvidia.com/gpu-10gb``
    pod.  Supported iff the plan places the pod and its layout hosts a slice inside an
    instance; otherwise the planner's reason is returned.
    """
    plan_fn = planner if planner is not None else _default_planner
    node = NodeState("probe-node", Mode.HYBRID, GPU_MODEL, (GpuState(0),))
    pod = PendingPod("probe-pod", {"nvidia.com/gpu-10gb": 1}, cpu_milli=1)
    try:
        result = plan_fn(Snapshot((node,), (pod,)), PlannerSettings())
    except Exception as e:  # any refusal is the answer
        return False, f"planner.plan raised {type(e).__name__}: {e}"
    if "probe-pod" not in result.assignments:
        return False, (
            "planner.plan leaves an nvidia.com/gpu-10gb pod on an empty hybrid node unplaced: "
            f"{result.unplaced.get('probe-pod', '?')}"
        )
    planned = result.layouts.get(("probe-node", 0))
    hosts = getattr(result.assignments["probe-pod"], "hosts", {})
    if planned is None or not getattr(planned, "mig_mps", ()) or not hosts:
        return False, (
            "planner.plan places the nvidia.com/gpu-10gb pod on the hybrid node but its plan "
            "names no MPS slice inside a MIG instance (PlannedGpu.mig_mps, Assignment.hosts)"
        )
    return True, "planner.plan hosts MPS slices inside MIG instances on hybrid nodes"
