"""gpuslice planner: the pure decision core (catalog, geometry, snapshot types, planners).

``plan(snapshot, settings) -> Plan`` is the entry point; see :mod:`planner.api`.

The names below are resolved on first use (PEP 562), so ``planner.catalog`` or
``planner.snapshot`` can be imported without loading OR-Tools (about 3 s): the node agent's
catalog probe and the CLI's light commands need the catalog only.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from planner.api import plan, validate_snapshot
    from planner.catalog import Catalog, GpuModel, MigProfile, default_catalog
    from planner.demand import SnapshotError
    from planner.settings import PlacementWeight, PlannerSettings, Policy, ThreadPolicy
    from planner.snapshot import (
        Assignment,
        GpuState,
        MigInstance,
        Mode,
        MpsSlice,
        NodeState,
        PendingPod,
        Plan,
        PlannedGpu,
        PlannedSlice,
        Snapshot,
        Unplaced,
    )

_HOME = {
    "plan": "planner.api",
    "validate_snapshot": "planner.api",
    "Catalog": "planner.catalog",
    "GpuModel": "planner.catalog",
    "MigProfile": "planner.catalog",
    "default_catalog": "planner.catalog",
    "SnapshotError": "planner.demand",
    "PlacementWeight": "planner.settings",
    "PlannerSettings": "planner.settings",
    "Policy": "planner.settings",
    "ThreadPolicy": "planner.settings",
}
"""Name -> module for each export not in :mod:`planner.snapshot`."""


def __getattr__(name: str) -> Any:
    if name in __all__:
        value = getattr(importlib.import_module(_HOME.get(name, "planner.snapshot")), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'planner' has no attribute {name!r}")


__all__ = [
    "Assignment",
    "Catalog",
    "GpuModel",
    "GpuState",
    "MigInstance",
    "MigProfile",
    "Mode",
    "MpsSlice",
    "NodeState",
    "PendingPod",
    "PlacementWeight",
    "Plan",
    "PlannedGpu",
    "PlannedSlice",
    "PlannerSettings",
    "Policy",
    "Snapshot",
    "SnapshotError",
    "ThreadPolicy",
    "Unplaced",
    "default_catalog",
    "plan",
    "validate_snapshot",
]
