"""FGD's fragmentation measure (Weng et al., USENIX ATC'23; see ../shared/facts/fgd.md §5-6).

Model
-----
*Target workload* M (:class:`TargetWorkload`), built once from the **original** pods: group them
by shape key (cpu_milli, gpu_milli, num_gpu, gpu_spec) — memory is not part of the key — sort
the shapes by count descending (ties: key descending, cpu first, then gpu_milli, num_gpu and the
spec string), keep shapes from the top until the cumulative count reaches 95 % of all pods
(inclusive), and give each kept shape ``p_m = count_m / Σ kept counts``.

*Node state*: free CPU, the free milli-GPU ``f_g`` of each GPU, and the GPU model.
``idle = Σ_g f_g``.  For a shape m:

* CPU-only m: ``frag = idle`` (always);
* m's ``gpu_spec`` excludes the node's model: ``frag = idle``;
* m fits (``cpu_free >= cpu_m`` and ``#{g: f_g >= gpu_milli_m} >= num_gpu_m``):
  ``frag = Σ f_g over the GPUs with f_g < gpu_milli_m``;
* m does not fit: ``frag = idle``.

``F_n = Σ_m p_m · frag_n(m)`` (milli-GPU, float64).  A node without GPUs has ``F = 0``.
Sums follow the reference's bucket order so that equal states give bit-equal values: Q1
(lacks CPU and GPU), Q2 (lacks GPU, plus the fitting shapes' fragments), Q4 (lacks CPU), XL/XR
(CPU-only shapes that fit / lack CPU), NA (model excluded), each filled in shape order.

Cluster metrics (§6): fragmentation *amount* ``100 · Σ_n F_n / 1000 / total_gpus`` (percent of
the cluster's GPU capacity) and *ratio* ``100 · Σ_n F_n / Σ_n idle_n``.

Speed: :class:`FragModel` memoises ``F`` per (model class, cpu_free, sorted free tuple); nodes
in identical states share one entry, and models that every shape treats alike share a class.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from simulations.inputs.workload import Pod

__all__ = [
    "FragModel",
    "TargetShape",
    "TargetWorkload",
    "frag_amount_pct",
    "frag_ratio_pct",
]

COVERAGE = 0.95
"""Share of the original pods the kept shapes must cover (FGD's 95 %)."""


@dataclass(frozen=True, slots=True)
class TargetShape:
    """One shape of the target workload with its probability."""

    cpu_milli: int
    gpu_milli: int
    num_gpu: int
    gpu_spec: tuple[str, ...]
    count: int
    p: float

    @property
    def is_cpu_only(self) -> bool:
        return self.num_gpu == 0

    def allows_model(self, model: str) -> bool:
        return not self.gpu_spec or model in self.gpu_spec


@dataclass(frozen=True, slots=True)
class TargetWorkload:
    """FGD's target workload M: the most frequent shapes covering 95 % of the pods."""

    shapes: tuple[TargetShape, ...]
    total_pods: int
    distinct_shapes: int

    @classmethod
    def from_pods(cls, pods: Iterable[Pod], coverage: float = COVERAGE) -> TargetWorkload:
        counts = Counter(p.shape for p in pods)
        if not counts:
            raise ValueError("target workload: no pods to build it from")
        total = sum(counts.values())
        ordered = sorted(
            counts.items(),
            key=lambda kv: (kv[1], kv[0][0], kv[0][1], kv[0][2], "|".join(kv[0][3])),
            reverse=True,
        )
        kept: list[tuple[tuple[int, int, int, tuple[str, ...]], int]] = []
        cum = 0
        for key, count in ordered:
            kept.append((key, count))
            cum += count
            if cum / total >= coverage:
                break
        kept_total = sum(c for _, c in kept)
        shapes = tuple(
            TargetShape(cpu, gm, ng, spec, count, count / kept_total)
            for (cpu, gm, ng, spec), count in kept
        )
        return cls(shapes=shapes, total_pods=total, distinct_shapes=len(counts))

    @property
    def coverage(self) -> float:
        return sum(s.count for s in self.shapes) / self.total_pods


class FragModel:
    """Per-node FGD fragmentation ``F`` for one target workload, memoised by node state.

    ``model_class(model)`` maps a GPU model label to a small integer; models that every target
    shape treats alike (same ``gpu_spec`` access) share a class, so their states share memo
    entries.  ``frag(cls, cpu_free, frees)`` takes the free milli-GPU values **sorted** (the
    measure depends only on their multiset).
    """

    def __init__(self, target: TargetWorkload) -> None:
        self.target = target
        self._shapes = tuple((s.cpu_milli, s.gpu_milli, s.num_gpu, s.p) for s in target.shapes)
        self._class_of_access: dict[tuple[bool, ...], int] = {}
        self._access: list[tuple[bool, ...]] = []
        self._model_class: dict[str, int] = {}
        self._memo: dict[tuple[int, int, tuple[int, ...]], float] = {}

    def model_class(self, model: str) -> int:
        cls = self._model_class.get(model)
        if cls is None:
            access = tuple(s.allows_model(model) for s in self.target.shapes)
            cls = self._class_of_access.get(access)
            if cls is None:
                cls = len(self._access)
                self._access.append(access)
                self._class_of_access[access] = cls
            self._model_class[model] = cls
        return cls

    def frag(self, cls: int, cpu_free: int, frees: tuple[int, ...]) -> float:
        key = (cls, cpu_free, frees)
        v = self._memo.get(key)
        if v is None:
            v = self._compute(self._access[cls], cpu_free, frees)
            self._memo[key] = v
        return v

    @property
    def memo_size(self) -> int:
        return len(self._memo)

    def _compute(self, access: Sequence[bool], cpu: int, frees: tuple[int, ...]) -> float:
        if not frees:
            return 0.0
        idle = sum(frees)
        q1 = q2 = q4 = xl = xr = na = 0.0
        for i, (c, gm, k, p) in enumerate(self._shapes):
            if k == 0:
                if cpu >= c:
                    xl += p * idle
                else:
                    xr += p * idle
                continue
            if not access[i]:
                na += p * idle
                continue
            fitting = 0
            low = 0
            for f in frees:
                if f >= gm:
                    fitting += 1
                else:
                    low += f
            if cpu >= c:
                q2 += p * (low if fitting >= k else idle)
            elif fitting >= k:
                q4 += p * idle
            else:
                q1 += p * idle
        return q1 + q2 + q4 + xl + xr + na


def frag_amount_pct(cluster_frag: float, total_gpus: int) -> float:
    """Fragmentation amount: percent of the cluster's GPU capacity that is fragmented."""
    return 100.0 * cluster_frag / 1000.0 / total_gpus


def frag_ratio_pct(cluster_frag: float, idle_milli: float) -> float:
    """Fragmentation ratio: percent of the idle GPU capacity that is fragmented (0 if none idle)."""
    return 100.0 * cluster_frag / idle_milli if idle_milli > 0 else 0.0
