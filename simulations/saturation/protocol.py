"""The saturation protocol of the FGD paper (../shared/facts/fgd.md §2-3, §6).

Protocol, per seed ``s`` (one ``random.Random(s)`` drives every draw, in this order)
-------------------------------------------------------------------------------
1. Sort the original pods by name and shuffle them: the arrival order of the originals.
2. Tune to ``target`` (1.3) × capacity ``C = 1000 × total GPUs``: with ``R`` the originals'
   total GPU request, while ``R < T`` draw an original uniformly with replacement (from the
   name-sorted list); stop (and discard it) when ``R`` plus its **per-GPU** share would exceed
   ``T``; else append a copy at the end and add its **total** request.  If ``R > T`` instead,
   remove pods uniformly at random until ``R <= T``.
3. Node rank: a uniform permutation of the name-sorted nodes (node ``i`` gets rank
   ``perm[i]``), fixed for the run; score ties go to the smallest rank.
4. Pods arrive one at a time (or in batches of ``k``: the policy may order each batch, see
   :meth:`~simulations.saturation.policies.baselines.Policy.order_batch`); each is tried once: placed on
   the node the policy chooses among the feasible ones, or failed and dropped.  Nothing departs.
5. After every pod (placed or failed) record arrived demand (failed pods count), allocated
   milli-GPU, the cluster fragmentation ``Σ_n F_n`` and idle milli-GPU.

Discrete curve (§2.6): per event ``arrive = round(arrived / G / 10)`` (Python's half-to-even) and
``alloc = round(used / G / 10, 2)`` with ``G`` total GPUs; the value at integer ``a`` is the mean
``alloc`` of the events with ``arrive == a`` (rounded to 2 places), else of those within
``a ± 1``, else missing.  ``alloc@130`` is the headline number.  Fragmentation amount
(``100·F/1000/G``) and ratio (``100·F/idle``, 2 decimals per event) are binned the same way.

The target workload for FGD's measure is built from the original pods, before tuning
(:class:`~simulations.saturation.fragmentation.TargetWorkload`); policies see it, never future arrivals.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from simulations.inputs.cluster import Cluster
from simulations.inputs.limits import MAX_PODS
from simulations.inputs.workload import GPU_MILLI, Pod, Workload, clip
from simulations.saturation.fragmentation import FragModel, TargetWorkload
from simulations.saturation.policies import make_policy
from simulations.saturation.policies.baselines import Policy
from simulations.saturation.policies.state import ShareState

__all__ = [
    "SaturationResult",
    "build_arrivals",
    "describe",
    "discrete_curve",
    "node_ranks",
    "run_saturation",
]

TARGET_RATIO = 1.3
CURVE_MAX = 130

Progress = Callable[[int, int], None]
"""``progress(done, total)``, called every few hundred pods and at the end."""


def build_arrivals(
    originals: Sequence[Pod],
    capacity_milli: int,
    rng: random.Random,
    target: float = TARGET_RATIO,
    *,
    workload: str = "the workload",
) -> list[Pod]:
    """Steps 1-2: shuffled originals, then clones drawn with replacement up to ``target``.

    The check against the target uses a draw's per-GPU share and the sum adds its total request,
    as fgd.md §2 prescribes: both are 0 for a CPU-only pod and both positive for a GPU pod.
    ``ValueError`` (naming ``workload``) when no pod asks for GPU capacity (tuning would draw
    forever), when it would take more than :data:`MAX_PODS` copies, or when trimming to the
    target leaves no pod (the last one removed asks for more than the target on its own)."""
    by_name = sorted(originals, key=lambda p: p.name)
    arrivals = list(by_name)
    rng.shuffle(arrivals)
    limit = target * capacity_milli
    requested = sum(p.total_gpu_milli for p in by_name)
    if requested == 0:
        raise ValueError(
            f"{workload}: none of its {len(by_name):,} pod(s) asks for a GPU share, so the "
            f"saturation protocol cannot fill the cluster's GPUs to {target:.0%}; give some "
            "pods num_gpu and gpu_milli"
        )
    if requested < limit:
        while True:
            pod = by_name[rng.randrange(len(by_name))]
            if requested + pod.gpu_milli > limit:
                break
            arrivals.append(pod)
            requested += pod.total_gpu_milli
            if len(arrivals) - len(by_name) > MAX_PODS:
                raise ValueError(
                    f"{workload}: filling the cluster's {capacity_milli // GPU_MILLI:,} GPUs "
                    f"to {target:.0%} takes more than {MAX_PODS:,} copies of its pods (they "
                    "ask for little GPU capacity); use a smaller cluster or more GPU pods"
                )
    else:
        while requested > limit:
            pod = arrivals.pop(rng.randrange(len(arrivals)))
            requested -= pod.total_gpu_milli
        if not arrivals:  # the last pod removed asks for more than the target on its own
            raise ValueError(
                f"{workload}: pod {clip(pod.name)!r} asks for "
                f"{pod.total_gpu_milli / GPU_MILLI:g} GPUs, more than {target:.0%} of the "
                f"cluster's {capacity_milli // GPU_MILLI:,}, and trimming the pods to that "
                "target left none; use a larger cluster or smaller pods"
            )
    return arrivals


def describe(workload: Workload) -> str:
    """``workload 'name' (source)`` for messages."""
    source = workload.source if len(workload.source) <= 200 else f"{workload.source[:200]}..."
    return f"workload {clip(workload.name)!r}" + (f" ({source})" if source else "")


def node_ranks(cluster: Cluster, rng: random.Random) -> list[int]:
    """Step 3: rank of each node of ``cluster.nodes`` (a permutation over name-sorted nodes)."""
    names = sorted(range(len(cluster.nodes)), key=lambda i: cluster.nodes[i].name)
    perm = list(range(len(names)))
    rng.shuffle(perm)
    rank = [0] * len(names)
    for sorted_pos, node_i in enumerate(names):
        rank[node_i] = perm[sorted_pos]
    return rank


@dataclass(frozen=True, slots=True)
class Curve:
    """Per-integer-percent binned values (index = arrived demand in % of capacity)."""

    alloc: tuple[float | None, ...]
    frag_amount: tuple[float | None, ...]
    frag_ratio: tuple[float | None, ...]


def _bin(
    values: npt.NDArray[np.float64], bins: npt.NDArray[np.int64], a: int, digits: int | None
) -> float | None:
    sel = bins == a
    if not sel.any():
        sel = (bins >= a - 1) & (bins <= a + 1)
        if not sel.any():
            return None
    m = float(np.mean(values[sel]))
    return round(m, digits) if digits is not None else m


def discrete_curve(
    arrived: npt.NDArray[np.int64],
    used: npt.NDArray[np.int64],
    frag: npt.NDArray[np.float64],
    total_gpus: int,
    upto: int = CURVE_MAX,
    idle: npt.NDArray[np.float64] | None = None,
) -> Curve:
    """The binned curves of fgd.md §2.6 / §6 from per-event records.

    ``idle`` is the free milli-GPU the fragmentation ratio divides by; by default capacity
    minus ``used`` (a GPU-share state, where both count the same milli)."""
    bins = np.array([round(a / total_gpus / 10) for a in arrived.tolist()], dtype=np.int64)
    alloc = np.array([round(u / total_gpus / 10, 2) for u in used.tolist()])
    if idle is None:
        idle = (total_gpus * GPU_MILLI - used).astype(np.float64)
    amount = 100.0 * frag / 1000.0 / total_gpus
    ratio = np.array(
        [
            round(100.0 * f / i, 2) if i > 0 else 0.0
            for f, i in zip(frag.tolist(), idle.tolist(), strict=True)
        ]
    )
    r = range(upto + 1)
    return Curve(
        alloc=tuple(_bin(alloc, bins, a, 2) for a in r),
        frag_amount=tuple(_bin(amount, bins, a, None) for a in r),
        frag_ratio=tuple(_bin(ratio, bins, a, None) for a in r),
    )


@dataclass(slots=True)
class SaturationResult:
    """One run: per-event records, the binned curve and headline numbers."""

    policy: str
    seed: int
    batch: int
    cluster: str
    workload: str
    total_gpus: int
    pods: int
    placed: int
    failed: int
    failed_gpu_milli: int
    arrived: npt.NDArray[np.int64]
    used: npt.NDArray[np.int64]
    frag: npt.NDArray[np.float64]
    curve: Curve
    runtime_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def at(self, series: str, percent: int) -> float | None:
        values: tuple[float | None, ...] = getattr(self.curve, series)
        return values[percent] if 0 <= percent < len(values) else None

    @property
    def final_alloc_pct(self) -> float:
        return 100.0 * float(self.used[-1]) / (self.total_gpus * GPU_MILLI)

    @property
    def unallocated_gpus(self) -> float:
        """Whole-GPU equivalents left idle at the end."""
        return (self.total_gpus * GPU_MILLI - float(self.used[-1])) / GPU_MILLI

    def summary(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "seed": self.seed,
            "batch": self.batch,
            "pods": self.pods,
            "placed": self.placed,
            "failed": self.failed,
            "alloc@130": self.at("alloc", 130),
            "alloc@100": self.at("alloc", 100),
            "frag_amount@100": self.at("frag_amount", 100),
            "frag_ratio@100": self.at("frag_ratio", 100),
            "final_alloc": round(self.final_alloc_pct, 4),
            "unallocated_gpus": round(self.unallocated_gpus, 3),
            "runtime_s": round(self.runtime_s, 3),
        }


def run_saturation(
    cluster: Cluster,
    workload: Workload,
    policy: str | Policy,
    seed: int,
    *,
    batch: int = 1,
    target: float = TARGET_RATIO,
    progress: Progress | None = None,
) -> SaturationResult:
    """Run the saturation protocol once (see the module docstring)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if cluster.total_gpus == 0:
        raise ValueError(
            f"cluster {cluster.name!r} has no GPUs: the saturation protocol needs some"
        )
    started = time.perf_counter()
    pol = make_policy(policy) if isinstance(policy, str) else policy
    rng = random.Random(seed)
    capacity = cluster.total_gpus * GPU_MILLI
    arrivals = build_arrivals(workload.pods, capacity, rng, target, workload=describe(workload))
    rank = node_ranks(cluster, rng)
    target_wl = TargetWorkload.from_pods(workload.pods)
    state = ShareState(cluster, rank, FragModel(target_wl))
    pol.prepare(state, workload.pods)

    n = len(arrivals)
    arrived = np.zeros(n, dtype=np.int64)
    used = np.zeros(n, dtype=np.int64)
    frag = np.zeros(n, dtype=np.float64)
    total_arrived = placed = failed_milli = 0
    event = 0
    step = max(1, n // 200)
    for start in range(0, n, batch):
        for pod in pol.order_batch(arrivals[start : start + batch]):
            feasible = state.feasible(pod)
            if feasible.size:
                node, gpus = pol.choose(state, pod, feasible)
                state.place(node, pod, gpus)
                placed += 1
            else:
                failed_milli += pod.total_gpu_milli
            total_arrived += pod.total_gpu_milli
            arrived[event] = total_arrived
            used[event] = state.used_milli
            frag[event] = state.cluster_frag
            event += 1
            if progress is not None and event % step == 0:
                progress(event, n)
    if progress is not None:
        progress(n, n)
    return SaturationResult(
        policy=pol.name,
        seed=seed,
        batch=batch,
        cluster=cluster.name,
        workload=workload.name,
        total_gpus=cluster.total_gpus,
        pods=n,
        placed=placed,
        failed=n - placed,
        failed_gpu_milli=failed_milli,
        arrived=arrived,
        used=used,
        frag=frag,
        curve=discrete_curve(arrived, used, frag, cluster.total_gpus),
        runtime_s=time.perf_counter() - started,
        extra={"target_shapes": len(target_wl.shapes), "frag_memo": state.frag_model.memo_size},
    )
