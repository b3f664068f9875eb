"""The FGD paper's baseline policies, re-implemented from ../shared/facts/fgd.md §3-5.

Both choose a node among the feasible ones by an integer score, ties to the smallest rank
(the first maximum, since :class:`~simulations.saturation.policies.state.ShareState` stores nodes in rank
order); a single feasible node is taken without scoring.

BestFit (§4)
    ``s = 0.5·(cpu_free - cpu)/max_cpu + 0.5·(gpu_idle - gpu_total)/max_gpu`` (``max_cpu`` and
    ``max_gpu`` = the largest node's CPU and GPU milli: 128000 and 8000 on openb), evaluated in
    float64 in that order; ``raw = trunc(100·(1 - s))``; maximum wins.  Sharing pods go to the
    GPU with the least free milli still >= the request; whole-GPU pods to the lowest-indexed
    free GPUs.

FGD (§5)
    ``score = trunc(100·sigmoid(-Δ/1000))`` where ``Δ = F_after - F_before`` is the change of the
    node's fragmentation (:mod:`simulations.saturation.fragmentation`) caused by the hypothetical placement.
    Sharing pods try every GPU with enough free milli; the node scores the best of them and the
    pod takes the lowest-indexed GPU reaching it.  Other pods: CPU drops, and ``num_gpu`` fully
    free GPUs drop to 0.

Speed
-----
FGD's score of a node for a pod depends only on the node's state (model class, free CPU, sorted
free GPU tuple) and the pod's (cpu, gpu_milli, num_gpu).  Scores are cached per (pod shape,
node) and invalidated by the node's ``version`` (only the chosen node changes per placement),
and memoised per (state, shape) so that nodes in identical states are scored once.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from simulations.inputs.workload import GPU_MILLI, Pod
from simulations.saturation.policies.state import IntArray, ShareState

__all__ = ["BestFit", "Decision", "Fgd", "FragMeasure", "Policy", "ScoreCache", "fgd_score"]

Decision = tuple[int, tuple[int, ...]]
"""(node index in rank order, GPU indices)."""

ShapeKey = tuple[int, int, int]
"""(cpu_milli, gpu_milli, num_gpu): everything a node score depends on besides the node."""


class FragMeasure(Protocol):
    """A per-node fragmentation measure over (model class, free CPU, sorted free GPU milli)."""

    def model_class(self, model: str) -> int: ...

    def frag(self, cls: int, cpu_free: int, frees: tuple[int, ...]) -> float: ...


class Policy(ABC):
    """A saturation-protocol policy: order a batch of arrivals, then place pods one by one."""

    name: str = "policy"

    def prepare(self, state: ShareState, originals: Sequence[Pod]) -> None:  # noqa: B027
        """Called once before the first pod with the *original* pods (the target workload's
        source, as FGD uses it); policies never see the arrival sequence ahead of time."""

    def order_batch(self, batch: Sequence[Pod]) -> list[Pod]:
        """The order in which a batch of arrivals is placed (default: arrival order)."""
        return list(batch)

    @abstractmethod
    def choose(self, state: ShareState, pod: Pod, feasible: IntArray) -> Decision:
        """Pick a node among ``feasible`` (non-empty, ascending ranks) and the pod's GPUs."""


def fgd_score(delta: float) -> int:
    """``trunc(100·sigmoid(-Δ/1000))``, an integer usually in 0..99."""
    x = delta / 1000.0
    if x > 700.0:  # exp overflows; the score is 0 long before
        return 0
    return int(100.0 * (1.0 / (1.0 + math.exp(x))))


class BestFit(Policy):
    name = "bestfit"

    def choose(self, state: ShareState, pod: Pod, feasible: IntArray) -> Decision:
        if feasible.size == 1:
            n = int(feasible[0])
        else:
            s = ((state.cpu_free[feasible] - pod.cpu_milli) / state.max_node_cpu) * 0.5
            s = s + ((state.idle[feasible] - pod.total_gpu_milli) / state.max_node_gpu_milli) * 0.5
            raw = np.trunc((1.0 - s) * 100.0)
            n = int(feasible[int(np.argmax(raw))])
        return n, state.default_gpus(n, pod)


class ScoreCache:
    """Per (pod shape, node) integer scores, valid while the node's version is unchanged."""

    def __init__(self, nodes: int) -> None:
        self._rows: dict[ShapeKey, int] = {}
        self.scores: npt.NDArray[np.int64] = np.zeros((0, nodes), dtype=np.int64)
        self.versions: npt.NDArray[np.int64] = np.zeros((0, nodes), dtype=np.int64)

    def row(self, key: ShapeKey) -> int:
        r = self._rows.get(key)
        if r is None:
            r = len(self._rows)
            self._rows[key] = r
            n = self.scores.shape[1]
            self.scores = np.vstack([self.scores, np.zeros((1, n), dtype=np.int64)])
            self.versions = np.vstack([self.versions, np.full((1, n), -1, dtype=np.int64)])
        return r


class Fgd(Policy):
    """Fragmentation Gradient Descent (see the module docstring)."""

    name = "fgd"

    def __init__(self) -> None:
        self._cache: ScoreCache | None = None
        self._memo: dict[
            tuple[int, int, tuple[int, ...], ShapeKey], tuple[int, tuple[int, ...]]
        ] = {}
        self._measure: FragMeasure | None = None
        self._cls: list[int] = []

    def prepare(self, state: ShareState, originals: Sequence[Pod]) -> None:
        self._cache = ScoreCache(len(state))
        self._memo = {}
        self._measure = self.make_measure(state, originals)
        self._cls = [self._measure.model_class(node.model) for node in state.nodes]

    def make_measure(self, state: ShareState, originals: Sequence[Pod]) -> FragMeasure:
        """The fragmentation measure scores descend on (FGD: the state's own F)."""
        return state.frag_model

    def node_score(self, state: ShareState, n: int, key: ShapeKey) -> tuple[int, tuple[int, ...]]:
        """FGD score of node ``n`` for a pod of shape ``key``, and the free values reaching it."""
        cls, cpu, frees = self._cls[n], int(state.cpu_free[n]), state.frees[n]
        mkey = (cls, cpu, frees, key)
        hit = self._memo.get(mkey)
        if hit is None:
            if self._measure is None:
                raise RuntimeError(f"{type(self).__name__}.prepare() was not called")
            hit = self._score_state(self._measure, cls, cpu, frees, key)
            self._memo[mkey] = hit
        return hit

    @staticmethod
    def delta_score(delta: float) -> int:
        """The integer score of a change ``delta`` of the measure (FGD: :func:`fgd_score`)."""
        return fgd_score(delta)

    def _score_state(
        self, measure: FragMeasure, cls: int, cpu: int, frees: tuple[int, ...], key: ShapeKey
    ) -> tuple[int, tuple[int, ...]]:
        frag, score = measure.frag, self.delta_score
        c, gm, k = key
        before = frag(cls, cpu, frees)
        if k == 0:
            return score(frag(cls, cpu - c, frees) - before), ()
        if gm == GPU_MILLI:
            after = tuple(sorted(frees[: len(frees) - k] + (0,) * k))  # frees sorted: 1000s last
            return score(frag(cls, cpu - c, after) - before), ()
        best: int | None = None
        values: list[int] = []
        for v in sorted({f for f in frees if f >= gm}):
            rest = list(frees)
            rest.remove(v)
            rest.append(v - gm)
            s = score(frag(cls, cpu - c, tuple(sorted(rest))) - before)
            if best is None or s > best:
                best, values = s, [v]
            elif s == best:
                values.append(v)
        if best is None:
            raise ValueError(f"no free GPU share >= {gm} milli among {frees}")
        return best, tuple(values)

    def scores(self, state: ShareState, pod: Pod, feasible: IntArray) -> npt.NDArray[np.int64]:
        """The FGD score of every feasible node (cached; see the module docstring)."""
        cache = self._cache
        if cache is None:
            raise RuntimeError("Fgd.prepare() was not called")
        key: ShapeKey = (pod.cpu_milli, pod.gpu_milli, pod.num_gpu)
        r = cache.row(key)
        srow: npt.NDArray[np.int64] = cache.scores[r]
        vrow: npt.NDArray[np.int64] = cache.versions[r]
        stale = feasible[vrow[feasible] != state.version[feasible]]
        for n in stale.tolist():
            srow[n] = self.node_score(state, n, key)[0]
            vrow[n] = state.version[n]
        scores: npt.NDArray[np.int64] = srow[feasible]
        return scores

    def gpus_for(self, state: ShareState, n: int, pod: Pod) -> tuple[int, ...]:
        if pod.is_sharing:
            key: ShapeKey = (pod.cpu_milli, pod.gpu_milli, pod.num_gpu)
            return (state.first_gpu_with(n, self.node_score(state, n, key)[1]),)
        return state.default_gpus(n, pod)

    def choose(self, state: ShareState, pod: Pod, feasible: IntArray) -> Decision:
        if feasible.size == 1:
            n = int(feasible[0])
        else:
            n = int(feasible[int(np.argmax(self.scores(state, pod, feasible)))])
        return n, self.gpus_for(state, n, pod)
