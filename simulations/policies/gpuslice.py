"""gpuslice's GPU-share (MPS) placement policy for the saturation protocol.

Model
-----
FGD (:class:`~simulations.policies.baselines.Fgd`) descends on a fragmentation measure that
treats CPU as a yes/no gate: if one pod of shape m fits the node's free CPU, *every* GPU with
room for m counts as usable by m.  On the openb cluster that is where FGD loses capacity:
8-GPU, 96-core nodes run out of CPU with GPUs still idle, because CPU-only and CPU-heavy pods
landed there while 104-core, 2-GPU nodes had CPU to spare.

gpuslice descends on a **CPU-aware** measure instead.  For a target shape m with
``cpu_m > 0`` the node's free CPU admits ``s_m = floor(cpu_free / cpu_m)`` more pods; each takes
``num_gpu_m`` GPUs, so at most ``s_m · num_gpu_m`` of the GPUs with ``f_g >= gpu_milli_m`` are
usable by m — the ones with the most free milli.  Then

* ``frag_m = idle - Σ (the min(#fit, s_m·num_gpu_m) largest f_g with f_g >= gpu_milli_m)``,
  when ``#fit >= num_gpu_m`` and ``s_m >= 1``;
* ``frag_m = idle`` otherwise, and for CPU-only shapes or models the shape's spec excludes.

When CPU admits a pod per fitting GPU this is exactly FGD's ``frag_m``, so the measure only
differs where CPU strands GPUs.  ``F' = Σ_m p_m · frag_m`` uses FGD's target workload (built
from the original pods; nothing about future arrivals), and the score is FGD's
``trunc(100·sigmoid(-ΔF'/1000))`` — the quantisation and the fixed node rank matter, as they do
for FGD (fgd.md §7).  The GPU of a sharing pod is, as in FGD, the lowest-indexed one reaching the
node's best score.

Batches: with ``k > 1`` arrivals per batch the pods of a batch are placed largest GPU request
first (a common bin-packing order); the benchmark reports ``k = 1`` (the default) beside it.
"""

from __future__ import annotations

from collections.abc import Sequence

from simulations.fragmentation import FragModel, TargetWorkload
from simulations.policies.baselines import Fgd, FragMeasure
from simulations.policies.state import ShareState
from simulations.workload import Pod

__all__ = ["CpuAwareFragModel", "GpusliceShare"]

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


class GpusliceShare(Fgd):
    """Fragmentation-gradient descent on the CPU-aware measure (GPU-share / MPS mode)."""

    name = "gpuslice"

    def make_measure(self, state: ShareState, originals: Sequence[Pod]) -> FragMeasure:
        return CpuAwareFragModel(TargetWorkload.from_pods(originals))

    def order_batch(self, batch: Sequence[Pod]) -> list[Pod]:
        return sorted(batch, key=lambda p: (-p.total_gpu_milli, -p.cpu_milli))
