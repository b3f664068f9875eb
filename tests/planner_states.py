"""Planner input builders shared by the planner tests."""

from __future__ import annotations

from planner import GpuState, MigInstance

__all__ = ["gpu"]


def gpu(index: int, *instances: tuple[str, int, bool]) -> GpuState:
    """A MIG GPU with instances given as ``(profile, start, used)``."""
    return GpuState(index, tuple(MigInstance(p, s, used=u) for p, s, u in instances))
