"""gpuslice planner: the pure decision core (catalog, geometry, snapshot types, planners).

``plan(snapshot, settings) -> Plan`` is the entry point; see :mod:`planner.api`.
"""

from planner.api import plan, validate_snapshot
from planner.catalog import Catalog, GpuModel, MigProfile, default_catalog
from planner.demand import SnapshotError
from planner.settings import PlannerSettings, Policy, ThreadPolicy
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
