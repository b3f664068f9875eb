"""Synthetic workloads on a small A100 MIG cluster, for the time-replay tests."""

from __future__ import annotations

from collections.abc import Sequence

from planner.snapshot import Mode
from simulations.inputs.cluster import Cluster, Node
from simulations.inputs.workload import PodShape, SyntheticSpec, Workload, synthetic_workload

A100 = "A100-SXM4-80GB"


def mig_workload(
    name: str,
    mix: Sequence[PodShape],
    *,
    count: int,
    rate_per_s: float,
    mean_duration_s: float,
    seed: int,
) -> tuple[Workload, Cluster]:
    """``count`` pods of ``mix`` arriving at ``rate_per_s`` on two A100 MIG nodes of 2 GPUs
    (64 CPUs, 500 GiB each), as cluster ``name``."""
    wl = synthetic_workload(
        SyntheticSpec(
            count=count,
            mix=tuple(mix),
            arrival_rate_per_s=rate_per_s,
            mean_duration_s=mean_duration_s,
            seed=seed,
        )
    )
    nodes = tuple(Node(f"n{i}", 64000, 512000, 2, A100, Mode.MIG, A100) for i in range(2))
    return wl, Cluster(name, nodes)
