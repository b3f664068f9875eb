"""Bounds of the simulator's inputs: counts and quantities no real trace or cluster comes near.

Every loader (:mod:`simulations.inputs.workload`, :mod:`simulations.inputs.cluster`, :mod:`simulations.inputs.openb`)
checks its values against these before building anything, so a value such as ``replicas: 1e8``
or ``count: 1000000000`` is refused at once with the file, the entry and the limit named,
instead of making the simulator build (or loop over) a billion objects.
"""

from __future__ import annotations

import math

from contract.input_files import MAX_GPUS_PER_NODE

__all__ = [
    "MAX_CPU_MILLI",
    "MAX_GPUS_PER_NODE",
    "MAX_MEMORY_MIB",
    "MAX_NODES",
    "MAX_PODS",
    "MAX_TABLE_ROWS",
    "MAX_TIME_S",
    "MAX_VALUE",
    "in_range",
]

MAX_PODS = 1_000_000
"""Pods in one workload, after ``replicas`` are expanded (the openb traces have about 8,000)."""
MAX_NODES = 100_000
"""Nodes in one cluster (Kubernetes supports 5,000; openb has 1,213)."""
MAX_CPU_MILLI = 10**9
"""CPU of one node or pod, milli-cores (a million cores)."""
MAX_MEMORY_MIB = 2**40
"""Memory of one node or pod, MiB (an exbibyte)."""
MAX_TIME_S = 10**10
"""Trace times, seconds, in magnitude (over 300 years).  The time replay stamps its pods at
its epoch (2026, :attr:`simulations.replay.engine.ReplaySettings.epoch_s`) plus a simulated
time below ``4 * MAX_TIME_S`` (an arrival within the span of creation times, plus a lifetime),
which stays before the year 9999, the last a timestamp can name."""
MAX_TABLE_ROWS = 2_000_000
"""Data rows of one CSV file."""
MAX_VALUE = 10**12
"""Any other integer of a trace row (e.g. ``gpu_milli`` before it is clipped to 0..1000)."""


def in_range(value: float, low: float, high: float, *, above: bool = False) -> bool:
    """``value`` is a finite number from ``low`` (excluded when ``above``) to ``high`` (NaN
    and the infinities are not: option checks refuse them by name; an int is compared exactly,
    however large)."""
    if isinstance(value, float) and not math.isfinite(value):
        return False  # nan compares False with everything, inf may be within an open range
    return (value > low if above else value >= low) and value <= high
