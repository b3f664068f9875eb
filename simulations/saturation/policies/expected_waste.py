"""Expected eventual waste of free GPU shares under FGD's target workload.

Model
-----
FGD's fragmentation (:mod:`simulations.saturation.fragmentation`) counts a GPU's free milli as lost for
every target shape that is *currently* too big for it, and as usable for every shape that fits
now — whatever that shape would leave behind.  A 530-milli hole looks useful to the 470-milli
shape, yet the 60 milli it then leaves can take almost nothing.  Here a free share is valued by
what is expected to remain of it once future pods have filled it as far as they can.

Let ``S`` be the single-GPU shapes of the target workload ``M`` (built from the original pods,
fgd.md §5) that a node can host: its GPU model is allowed by the shape's ``gpu_spec`` and its
free CPU is at least the shape's ``cpu_milli``.  Future pods are taken to arrive in the
proportions ``p_m`` of ``M``, and the next one of ``S`` that fits goes into the hole::

    w_S(h) = h                                                if no m in S has gpu_m <= h
    w_S(h) = Σ_{m∈S, gpu_m<=h} p_m · w_S(h - gpu_m)  /  Σ_{m∈S, gpu_m<=h} p_m     otherwise

and a node's expected waste is ``W = Σ_g w_S(f_g)`` over its GPUs' free milli ``f_g``.  On the
openb default trace, for a 96-core node: ``w(1000) ≈ 21.9``, ``w(530) ≈ 61.0``,
``w(350) ≈ 59.2``, ``w(60) = 60`` (nothing fits), and ``w(190) = 30`` (only the rare 160-milli
shape fits; the model does not see that many holes compete for few such pods).

The model ignores CPU-only and multi-GPU shapes and how many pods the node's CPU can still
host; the ``fgd-waste`` rule adds ``W`` to the CPU-aware fragmentation that covers those
(:class:`~simulations.saturation.policies.fgd_waste.FgdWasteMeasure`).

Speed: ``w_S`` is tabulated once per admitted set ``S`` for every ``h`` in ``0..1000`` (a
dynamic programme over ``h``); few distinct sets occur (model access x CPU thresholds).
"""

from __future__ import annotations

from collections.abc import Sequence

from simulations.inputs.workload import GPU_MILLI
from simulations.saturation.fragmentation import TargetWorkload

__all__ = ["ExpectedWaste"]

Admitted = tuple[tuple[int, float], ...]
"""The (gpu_milli, p) of the single-GPU target shapes a node can host."""


class ExpectedWaste:
    """``w_S(h)`` and the per-node sum ``W`` for one target workload (see the module docstring)."""

    def __init__(self, target: TargetWorkload) -> None:
        self.target = target
        # (index in target.shapes, cpu_milli, gpu_milli, p) of the single-GPU shapes
        self._single = tuple(
            (i, s.cpu_milli, s.gpu_milli, s.p)
            for i, s in enumerate(target.shapes)
            if s.num_gpu == 1
        )
        self._tables: dict[Admitted, tuple[float, ...]] = {}

    def admitted(self, access: Sequence[bool], cpu_free: int) -> Admitted:
        """The single-GPU shapes a node hosts: model allowed (``access[i]``) and CPU enough.

        ``access`` has one flag per target shape, in the order of ``target.shapes``.
        """
        if len(access) != len(self.target.shapes):
            raise ValueError(
                f"access has {len(access)} flags but the target workload has "
                f"{len(self.target.shapes)} shapes; pass one flag per shape"
            )
        return tuple((gm, p) for i, c, gm, p in self._single if access[i] and c <= cpu_free)

    def table(self, shapes: Admitted) -> tuple[float, ...]:
        """``w_S(h)`` for ``h = 0..1000`` (index = free milli)."""
        t = self._tables.get(shapes)
        if t is None:
            t = self._tabulate(shapes)
            self._tables[shapes] = t
        return t

    def hole(self, shapes: Admitted, free_milli: int) -> float:
        """``w_S(h)``: the expected milli left of a free share ``h`` once filled."""
        if not 0 <= free_milli <= GPU_MILLI:
            raise ValueError(f"free milli must be in 0..{GPU_MILLI}, got {free_milli}")
        return self.table(shapes)[free_milli]

    def node_waste(self, access: Sequence[bool], cpu_free: int, frees: Sequence[int]) -> float:
        """``W``: the sum of ``w_S(f_g)`` over a node's free GPU shares ``frees``."""
        t = self.table(self.admitted(access, cpu_free))
        return sum(t[f] for f in frees)

    @staticmethod
    def _tabulate(shapes: Admitted) -> tuple[float, ...]:
        by_size = sorted(shapes)
        w = [0.0] * (GPU_MILLI + 1)
        for h in range(GPU_MILLI + 1):
            num = den = 0.0
            for gm, p in by_size:
                if gm > h:
                    break
                num += p * w[h - gm]
                den += p
            w[h] = num / den if den > 0.0 else float(h)
        return tuple(w)
