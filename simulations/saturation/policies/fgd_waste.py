"""``fgd-waste``: a what-if GPU-share placement rule for the saturation protocol (simulator only).

This rule is **not** what production decides: production places GPU pods with
:func:`planner.plan` (the saturation protocol's ``gpuslice`` row, :mod:`simulations.saturation.runner`).
It is kept as a what-if baseline: how much a GPU-share scheduler that scores every node with
this measure could pack, beside BestFit and FGD.  Until 2026-12-01 it was the ``gpuslice`` row
of the README's GPU-share table.

Model
-----
Like FGD (:class:`~simulations.saturation.policies.baselines.Fgd`), the rule scores each feasible node by
how a hypothetical placement changes a per-node measure of lost capacity, takes the best score
and breaks ties by the fixed node rank (the smallest wins).  It changes the measure and the
score.

**Measure** ``G = F' + ½·W``, both parts built only from FGD's target workload (the original
pods' most frequent shapes and their probabilities ``p_m``; nothing about future arrivals):

* ``F'`` — FGD's fragmentation with CPU limiting how many GPUs a shape can use
  (:class:`CpuAwareFragModel`).  FGD treats CPU as a yes/no gate: if one pod of shape m fits the
  node's free CPU, *every* GPU with room for m counts as usable by m.  On openb, 8-GPU 96-core
  nodes run out of CPU with GPUs idle.  Here the free CPU admits ``s_m = floor(cpu_free /
  cpu_m)`` more pods of m, each taking ``num_gpu_m`` GPUs, so at most ``s_m·num_gpu_m`` of the
  GPUs with ``f_g >= gpu_milli_m`` (those with the most free milli) are usable:

  - ``frag_m = idle - Σ (the min(#fit, s_m·num_gpu_m) largest f_g >= gpu_milli_m)`` when
    ``#fit >= num_gpu_m`` and ``s_m >= 1``;
  - ``frag_m = idle`` otherwise, for CPU-only shapes, and for models the shape's spec excludes.

  Where CPU admits a pod per fitting GPU this equals FGD's ``frag_m``.  ``F' = Σ_m p_m·frag_m``.
* ``W`` — the expected milli each GPU's free share will still waste once future single-GPU
  pods have filled it (:class:`~simulations.saturation.policies.expected_waste.ExpectedWaste`): FGD's
  measure sees a 530-milli hole as usable by the 470-milli shape, ``W`` also sees the 60 milli
  that shape leaves.  Only shapes the node's model and free CPU admit take part.

**Score** ``-floor(ΔG / 20)`` with ``ΔG = G_after - G_before``: lower is better, in steps of
20 milli.  The quantisation matters as it does for FGD (fgd.md §7): placements within a step
tie and go to the smallest-ranked node, which packs nodes in a fixed order.

The GPU of a sharing pod is, as in FGD, the lowest-indexed one reaching the node's best score;
whole-GPU pods take the lowest-indexed fully free GPUs.

Batches: with ``k > 1`` arrivals per batch the pods of a batch are placed largest GPU request
first (a common bin-packing order); the benchmark reports ``k = 1`` (the default) beside it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from simulations.inputs.workload import Pod
from simulations.saturation.fragmentation import FragModel, TargetWorkload
from simulations.saturation.policies.baselines import Fgd, FragMeasure
from simulations.saturation.policies.expected_waste import ExpectedWaste
from simulations.saturation.policies.state import ShareState

__all__ = [
    "SCORE_STEP_MILLI",
    "WASTE_WEIGHT",
    "CpuAwareFragModel",
    "FgdWaste",
    "FgdWasteMeasure",
]

SCORE_STEP_MILLI = 20.0
"""Width of one score step of the measure's change (milli-GPU)."""

WASTE_WEIGHT = 0.5
"""Weight of the expected waste ``W`` beside the CPU-aware fragmentation ``F'``."""

_NO_CPU_LIMIT = 1 << 30


class CpuAwareFragModel(FragModel):
    """FGD's measure with CPU limiting how many GPUs a shape can use (see the module docstring)."""

    def _compute(self, access: Sequence[bool], cpu: int, frees: tuple[int, ...]) -> float:
        if not frees:
            return 0.0
        idle = sum(frees)
        desc = sorted(frees, reverse=True)
        total = 0.0
        for i, (c, gm, k, p) in enumerate(self._shapes):
            if k == 0 or not access[i]:
                total += p * idle
                continue
            fit = 0
            while fit < len(desc) and desc[fit] >= gm:
                fit += 1
            pods = cpu // c if c > 0 else _NO_CPU_LIMIT
            if fit < k or pods == 0:
                total += p * idle
            else:
                total += p * (idle - sum(desc[: min(fit, pods * k)]))
        return total


class FgdWasteMeasure(CpuAwareFragModel):
    """``G = F' + WASTE_WEIGHT · W`` per node (see the module docstring); memoised by state."""

    def __init__(self, target: TargetWorkload, waste_weight: float = WASTE_WEIGHT) -> None:
        if not math.isfinite(waste_weight) or waste_weight < 0:
            raise ValueError(f"waste_weight must be a finite number >= 0, got {waste_weight}")
        super().__init__(target)
        self.waste = ExpectedWaste(target)
        self.waste_weight = waste_weight

    def _compute(self, access: Sequence[bool], cpu: int, frees: tuple[int, ...]) -> float:
        if not frees:
            return 0.0
        frag = super()._compute(access, cpu, frees)
        return frag + self.waste_weight * self.waste.node_waste(access, cpu, frees)


def step_score(delta: float, step: float = SCORE_STEP_MILLI) -> int:
    """``-floor(delta / step)``: higher for a smaller increase of the measure."""
    return -math.floor(delta / step)


class FgdWaste(Fgd):
    """Descent on the CPU-aware fragmentation plus expected waste (GPU-share / MPS mode)."""

    name = "fgd-waste"

    def make_measure(self, state: ShareState, originals: Sequence[Pod]) -> FragMeasure:
        return FgdWasteMeasure(TargetWorkload.from_pods(originals))

    @staticmethod
    def delta_score(delta: float) -> int:
        return step_score(delta)

    def order_batch(self, batch: Sequence[Pod]) -> list[Pod]:
        return sorted(batch, key=lambda p: (-p.total_gpu_milli, -p.cpu_milli))
