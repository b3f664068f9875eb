"""Saturation-protocol placement policies: the FGD paper's baselines and gpuslice's own.

* ``bestfit`` — :class:`~simulations.saturation.policies.baselines.BestFit` (fgd.md §4);
* ``fgd`` — :class:`~simulations.saturation.policies.baselines.Fgd` (fgd.md §5);
* ``gpuslice`` — :class:`~simulations.saturation.policies.gpuslice.GpusliceShare`: FGD-style descent on a
  CPU-aware fragmentation measure plus the expected waste of free GPU shares
  (:mod:`simulations.saturation.policies.expected_waste`).

All act on a :class:`~simulations.saturation.policies.state.ShareState` (GPU-share / MPS mode).
"""

from __future__ import annotations

from collections.abc import Callable

from simulations.saturation.policies.baselines import BestFit, Fgd, Policy
from simulations.saturation.policies.gpuslice import GpusliceShare

__all__ = ["POLICIES", "BestFit", "Fgd", "GpusliceShare", "Policy", "make_policy"]

POLICIES: dict[str, Callable[[], Policy]] = {
    "bestfit": BestFit,
    "fgd": Fgd,
    "gpuslice": GpusliceShare,
}


def make_policy(name: str) -> Policy:
    """A fresh policy by name (``bestfit``, ``fgd``, ``gpuslice``)."""
    factory = POLICIES.get(name.lower())
    if factory is None:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    return factory()
