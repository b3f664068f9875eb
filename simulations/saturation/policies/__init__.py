"""GPU-share placement rules of the saturation protocol: the FGD paper's baselines and a what-if.

* ``bestfit`` — :class:`~simulations.saturation.policies.baselines.BestFit` (fgd.md §4);
* ``fgd`` — :class:`~simulations.saturation.policies.baselines.Fgd` (fgd.md §5);
* ``fgd-waste`` — :class:`~simulations.saturation.policies.fgd_waste.FgdWaste`: FGD-style descent on
  a CPU-aware fragmentation measure plus the expected waste of free GPU shares
  (:mod:`simulations.saturation.policies.expected_waste`); a what-if, not production's rule.

All act on a :class:`~simulations.saturation.policies.state.ShareState` (GPU shares in milli).
gpuslice itself is not a rule here: its row runs :func:`planner.plan` on MPS slices
(:mod:`simulations.saturation.runner`).
"""

from __future__ import annotations

from collections.abc import Callable

from simulations.saturation.policies.baselines import BestFit, Fgd, Policy
from simulations.saturation.policies.fgd_waste import FgdWaste

__all__ = ["POLICIES", "BestFit", "Fgd", "FgdWaste", "Policy", "make_policy"]

POLICIES: dict[str, Callable[[], Policy]] = {
    "bestfit": BestFit,
    "fgd": Fgd,
    "fgd-waste": FgdWaste,
}


def make_policy(name: str) -> Policy:
    """A fresh policy by name (``bestfit``, ``fgd``, ``fgd-waste``)."""
    factory = POLICIES.get(name.lower())
    if factory is None:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    return factory()
