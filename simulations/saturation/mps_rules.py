"""GPU-share placement rules on MPS slices: the saturation protocol as production runs it.

Why
---
In the FGD paper's protocol (:mod:`simulations.saturation.protocol`, the *scheduler protocol*) the policy
places every pod, CPU-only pods too, and FGD's figure owes much to that: on openb default,
seed 42, FGD reaches 95.59 % when it places the CPU-only pods and 93.70 % when BestFit places
them (README design notes).  gpuslice places GPU pods only; kube-scheduler places the others.
The *partitioner protocol* compares GPU placement rules under that condition, on the slices
production makes, so that the gpuslice row (:func:`planner.plan`) and the baselines answer the
same question.

Protocol (per seed; the same draws as :mod:`simulations.saturation.partitioned`)
------------------------------------------------------------------------------
* The cluster of :func:`simulations.saturation.partitioned.partitioned_cluster` in MPS mode (every
  GPU an A100-SXM4-80GB, the openb model kept as the node label for ``gpu_spec``); the arrivals
  and node rank of the seed.
* A pod of ``s`` milli per GPU asks for ``num_gpu`` MPS slices of ``floor(s × 79 / 1000)`` GiB
  (``mps-memory``; whole GPUs 79 GiB).  A node can host it when its CPU and memory suffice, its
  label matches ``gpu_spec`` and its GPUs' free memory holds the slices
  (:meth:`simulations.saturation.partitioned.PartitionedState.can_host`).
* CPU-only pods go where the row's CPU scheduler puts them, as in every partitioned row
  (:class:`simulations.saturation.partitioned.CpuScheduler`): BestFit of fgd.md §4 by
  default, or kube-scheduler's default (``least-allocated``) or bin-packing
  (``most-allocated``) profile.
* Each GPU pod is placed by a *rule* over **every** node that can host it, scoring the nodes'
  milli view (:mod:`simulations.saturation.mps_frag`):

  - ``bestfit`` (fgd.md §4): ``trunc(100 (1 - s))`` with ``s = ½ (cpu_free - cpu) / max_cpu +
    ½ (idle - request) / (max_gpus × 1000)``, ``idle`` the node's free milli and ``request``
    the pod's ``num_gpu × gpu_milli``; the GPU of a sharing pod is the one with the least free
    memory that holds the slice;
  - ``fgd`` (fgd.md §5): ``trunc(100 sigmoid(-ΔF / 1000))`` of the change of FGD's
    fragmentation of the node's milli view (target workload: the original pods);
  - ``fgd-waste`` (:mod:`simulations.saturation.policies.fgd_waste`): ``-floor(ΔG / 20)`` of its
    CPU-aware fragmentation plus half the expected waste.

  The highest score wins, ties to the smallest rank.  A sharing pod's GPU under ``fgd`` and
  ``fgd-waste`` is the lowest-indexed one reaching the node's score; whole-GPU pods take the
  lowest-indexed empty GPUs.  With batches of ``k`` the batch is ordered as the rule's
  GPU-share policy orders it (``fgd-waste``: largest first).
* Recorded as every saturation row: arrived and allocated GPU-milli (a pod counts its original
  share), and FGD's fragmentation of the milli view.

The gpuslice row of this protocol is :func:`simulations.saturation.partitioned.run_planned` in MPS mode:
the same cluster, arrivals, mapping and CPU-only placement, with :func:`planner.plan` deciding
each GPU pod (:mod:`simulations.saturation.runner`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from planner.mps import thread_percentage
from planner.settings import PlannerSettings
from planner.snapshot import Mode, MpsSlice
from simulations.inputs.cluster import Cluster
from simulations.inputs.mapping import SliceRequest, make_mapping
from simulations.inputs.workload import GPU_MILLI, Pod, Workload
from simulations.saturation.fragmentation import FragModel, TargetWorkload
from simulations.saturation.mps_frag import MpsFragTracker, milli_of
from simulations.saturation.partitioned import (
    CpuScheduler,
    PartitionedState,
    PlanViolation,
    SimNode,
    _Recorder,
    _result,
    _seeded,
)
from simulations.saturation.policies import make_policy
from simulations.saturation.policies.baselines import fgd_score
from simulations.saturation.policies.fgd_waste import FgdWasteMeasure, step_score
from simulations.saturation.protocol import TARGET_RATIO, Progress, SaturationResult

__all__ = ["RULES", "run_rule"]

MAPPING = "mps-memory"

Choice = tuple[int, tuple[int, ...]]
"""(score, GPU indices) of one node for one pod."""


class _Rule:
    """Scores one node for one pod on the milli view (module docstring)."""

    def __init__(self, state: PartitionedState, tracker: MpsFragTracker) -> None:
        self.state = state
        self.view = tracker
        self.full = tracker.full_mib

    def frees(self, node: SimNode) -> list[int]:
        return [milli_of(f, self.full) for f in node.free_mib]

    def choose(self, node: SimNode, pod: Pod, mib: int) -> Choice:
        raise NotImplementedError

    def whole(self, node: SimNode, count: int) -> tuple[int, ...]:
        """The ``count`` lowest-indexed empty GPUs."""
        empty = [i for i, f in enumerate(node.free_mib) if f >= self.state.usable_mib]
        return tuple(empty[:count])


class _BestFit(_Rule):
    def choose(self, node: SimNode, pod: Pod, mib: int) -> Choice:
        st = self.state
        s = 0.0 + ((node.cpu_free - pod.cpu_milli) / st.max_cpu) * 0.5
        idle = sum(self.frees(node))
        s += ((idle - pod.total_gpu_milli) / (st.max_gpus * GPU_MILLI)) * 0.5
        score = int((1.0 - s) * 100)
        if pod.num_gpu > 1 or mib >= self.full:
            return score, self.whole(node, pod.num_gpu)
        fits = [i for i, f in enumerate(node.free_mib) if f >= mib]
        return score, (min(fits, key=lambda i: (node.free_mib[i], i)),)


class _Descent(_Rule):
    """FGD-style: the score of the change of a per-node measure, GPU by GPU."""

    def __init__(
        self,
        state: PartitionedState,
        tracker: MpsFragTracker,
        measure: FragModel,
        score: Callable[[float], int],
    ) -> None:
        super().__init__(state, tracker)
        self.measure = measure
        self.score = score
        self._cls: dict[str, int] = {}

    def _value(self, node: SimNode, cpu: int, frees: Sequence[int]) -> float:
        cls = self._cls.get(node.label)
        if cls is None:
            cls = self._cls[node.label] = self.measure.model_class(node.label)
        return self.measure.frag(cls, cpu, tuple(sorted(frees)))

    def choose(self, node: SimNode, pod: Pod, mib: int) -> Choice:
        frees = self.frees(node)
        before = self._value(node, node.cpu_free, frees)
        cpu = node.cpu_free - pod.cpu_milli
        if pod.num_gpu > 1 or mib >= self.full:
            gpus = self.whole(node, pod.num_gpu)
            after = list(frees)
            for i in gpus:
                after[i] = 0
            return self.score(self._value(node, cpu, after) - before), gpus
        best: Choice | None = None
        seen: dict[int, int] = {}
        for i, free in enumerate(node.free_mib):
            if free < mib:
                continue
            left = milli_of(free - mib, self.full)
            key = frees[i] * (GPU_MILLI + 1) + left
            s = seen.get(key)
            if s is None:
                after = list(frees)
                after[i] = left
                s = seen[key] = self.score(self._value(node, cpu, after) - before)
            if best is None or s > best[0]:
                best = (s, (i,))
        if best is None:
            raise PlanViolation(f"node {node.name}: no GPU holds a {mib} MiB slice")
        return best


def _fgd(state: PartitionedState, tracker: MpsFragTracker, target: TargetWorkload) -> _Rule:
    return _Descent(state, tracker, tracker.model, fgd_score)


def _fgd_waste(state: PartitionedState, tracker: MpsFragTracker, target: TargetWorkload) -> _Rule:
    return _Descent(state, tracker, FgdWasteMeasure(target), step_score)


def _bestfit(state: PartitionedState, tracker: MpsFragTracker, target: TargetWorkload) -> _Rule:
    return _BestFit(state, tracker)


RULES: dict[str, Callable[[PartitionedState, MpsFragTracker, TargetWorkload], _Rule]] = {
    "bestfit": _bestfit,
    "fgd": _fgd,
    "fgd-waste": _fgd_waste,
}
"""Rule name -> factory (module docstring)."""


def _place(
    state: PartitionedState, node: SimNode, pod: Pod, gpus: tuple[int, ...], mib: int
) -> None:
    """Give ``pod`` a new used slice of ``mib`` MiB on each of ``gpus`` (checked)."""
    settings = PlannerSettings()
    for i in gpus:
        if node.free_mib[i] < mib:
            raise PlanViolation(f"node {node.name} GPU {i}: {mib} MiB do not fit")
        pct = thread_percentage(mib, state.usable_mib, settings.mps_thread_policy)
        node.gpus[i].mps.append(MpsSlice(mib, True, pct))
    node.cpu_free -= pod.cpu_milli
    node.mem_free -= pod.memory_mib
    state.used_milli += state.credit(pod, [mib] * len(gpus))
    state.refresh(node)


def run_rule(
    cluster: Cluster,
    workload: Workload,
    rule: str,
    seed: int,
    *,
    batch: int = 1,
    target: float = TARGET_RATIO,
    arrivals: Sequence[Pod] | None = None,
    progress: Progress | None = None,
    cpu_scheduler: CpuScheduler = CpuScheduler.BESTFIT,
) -> SaturationResult:
    """One seed of the partitioner protocol with a GPU-share ``rule`` (module docstring);
    ``cpu_scheduler`` places the CPU-only pods."""
    factory = RULES.get(rule)
    if factory is None:
        raise ValueError(f"unknown rule {rule!r}; choose one of {', '.join(RULES)}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    started = time.perf_counter()
    settings = PlannerSettings()
    part, state, drawn = _seeded(
        cluster, Mode.MPS, workload, seed, target, settings, arrivals, cpu_scheduler
    )
    mapper = make_mapping(MAPPING, state.model, settings.mps_reserve_mib)
    target_wl = TargetWorkload.from_pods(workload.pods)
    tracker = MpsFragTracker(state, target_wl)
    chooser = factory(state, tracker, target_wl)
    order = make_policy(rule).order_batch
    rec = _Recorder(len(drawn))
    step = max(1, len(drawn) // 200)
    for start in range(0, len(drawn), batch):
        for pod in order(drawn[start : start + batch]):
            ok = _one(state, tracker, chooser, mapper.map(pod), pod)
            rec.record(pod, ok, state.used_milli, tracker.total, tracker.idle)
            if progress is not None and rec.event % step == 0:
                progress(rec.event, rec.n)
    if progress is not None:
        progress(rec.n, rec.n)
    extra = {
        "mode": Mode.MPS.value,
        "mapping": MAPPING,
        "rule": rule,
        "cpu_scheduler": state.cpu_scheduler.value,
        **state.utilisation(),
    }
    return _result(f"mps:{rule}", seed, batch, part, workload, rec, started, extra)


def _one(
    state: PartitionedState,
    tracker: MpsFragTracker,
    chooser: _Rule,
    req: SliceRequest | None,
    pod: Pod,
) -> bool:
    """Place one arrival (module docstring); whether it was placed."""
    if req is None:
        went = state.place_cpu_only(pod)
        if went is not None:
            tracker.update((went,))
        return went is not None
    mib = (req.memory_gb or 0) * 1024
    best: tuple[tuple[int, int], SimNode, tuple[int, ...]] | None = None
    for node in state.nodes:
        if not state.can_host(node, pod, req):
            continue
        score, gpus = chooser.choose(node, pod, mib)
        key = (score, -node.rank)
        if best is None or key > best[0]:
            best = (key, node, gpus)
    if best is None:
        return False
    _, node, gpus = best
    if len(gpus) != req.count:
        raise PlanViolation(f"pod {pod.name}: node {node.name} chosen without {req.count} GPUs")
    _place(state, node, pod, gpus, mib)
    tracker.update((node,))
    return True
