"""Planner settings: one frozen dataclass, every field documented with its default."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "MAX_SEED",
    "MAX_TIME_LIMIT_S",
    "PlacementWeight",
    "PlannerSettings",
    "Policy",
    "ThreadPolicy",
]

MAX_SEED = 2**31 - 1
"""The largest CP-SAT random seed (a signed 32-bit integer)."""
MAX_TIME_LIMIT_S = 3600.0
"""The longest planner time limit accepted: a plan that may take longer than an hour would
hold every waiting pod that long (the partitioner plans batches every few seconds)."""


class Policy(StrEnum):
    CPSAT = "cpsat"
    """OR-Tools CP-SAT batch planner (default)."""
    GREEDY = "greedy"
    """nos-like one-pass greedy baseline."""


class ThreadPolicy(StrEnum):
    PROPORTIONAL = "proportional"
    """MPS active-thread % proportional to the slice's share of usable memory."""
    FULL = "full"
    """Every MPS client may use 100 % of the threads (no compute limit)."""


class PlacementWeight(StrEnum):
    PODS = "pods"
    """The placement level counts pods (default): among plans placing as many pods, the waiting
    tiers, then churn decide, whatever the pods' sizes."""
    COMPUTE = "compute"
    """The placement level counts the GPU compute placed (compute slices of each MIG unit; one
    per started 10 GB of each MPS slice): seven newer ``1g`` pods no longer outweigh a waiting
    ``7g`` pod, but a ``7g`` pod outweighs an older ``4g`` pod (in the openb replays ``4g`` pods
    then starved: README design notes)."""


@dataclass(frozen=True, slots=True)
class PlannerSettings:
    policy: Policy = Policy.CPSAT
    """Which planner decides."""
    time_limit_s: float = 1.0
    """CP-SAT wall-clock limit per plan; the best solution found by then is used.  Finite and
    above 0 (:data:`MAX_TIME_LIMIT_S` at most)."""
    seed: int = 0
    """CP-SAT random seed; with ``num_workers=1`` the plan is deterministic for a given input.
    0 to :data:`MAX_SEED` (CP-SAT's seed is a 32-bit integer)."""
    num_workers: int = 1
    """CP-SAT search workers. 1 keeps plans deterministic; more can be faster on big clusters."""
    weight_destroy: int = 4
    """Churn cost of destroying one free MIG instance / MPS slice."""
    weight_create: int = 2
    """Churn cost of creating one MIG instance / MPS slice."""
    weight_gpu_touched: int = 8
    """Churn cost of changing a GPU's layout at all."""
    weight_free_gpu: int = 4
    """Value of leaving a GPU with nothing on it (whole 7g still possible)."""
    weight_free_block: int = 1
    """Value per free memory slot kept in the largest aligned free block of a GPU."""
    free_capacity_cpu_milli: int | None = None
    """The target workload's CPU per pod: a node's free GPU capacity is valued (the two
    weights above) for at most as many GPUs as such pods could still get CPU on the node after
    the plan, since a GPU no pod can get CPU beside is stranded.  ``None``: learned from the
    batch, the lower quartile of its pods' requests (the pods waiting now stand for the next
    ones; :func:`planner.mig_cpsat.workload_needs`); 0: CPU-blind."""
    free_capacity_memory_mib: int | None = None
    """The same for node memory (MiB); ``None``: the batch's lower quartile."""
    free_capacity_mps_sizes: tuple[tuple[int, float], ...] | None = None
    """The target workload's MPS slice sizes: ``(MiB, weight)`` pairs.  An MPS GPU's free
    memory is valued by the share of these slices it could still hold (FGD's fragmentation,
    :mod:`planner.mps`).  ``None``: learned from the snapshot (the slices in use on MPS GPUs
    and those pending pods ask for); ``()``: only empty GPUs count."""
    free_capacity_mps_shapes: tuple[tuple[int, int, int, float], ...] | None = None
    """The target workload's MPS pod shapes for the packing polish (:mod:`planner.mps_polish`):
    ``(CPU milli, slice MiB, slices, weight)`` tuples.  ``None``: learned from the snapshot
    (the pending pods' shapes, and the slices in use with ``free_capacity_cpu_milli``);
    ``()``: no polish."""
    mps_polish: bool = True
    """Polish the solve's MPS placements with the node-level packing measure of
    :mod:`planner.mps_polish` (same pods placed, no more churn).  ``False``: the solve's
    placements as they are."""
    free_capacity_mig_profiles: tuple[tuple[str, float], ...] | None = None
    """The target workload's MIG requests: ``(resource, weight)`` pairs, e.g.
    ``(("nvidia.com/mig-7g.80gb", 3.0), ("nvidia.com/mig-4g.40gb", 1.0))``.  A free MIG
    instance is valued by its memory slots times its request's share of the target
    (:mod:`planner.mig_target`), so among plans placing as much with as little churn, the one
    that keeps free the instances the next pods ask for wins (a ``4g`` pod is carved from an idle
    GPU of little-asked ``3g`` instances rather than from a free ``7g``).  ``None``: learned from
    the snapshot (the instances in use on MIG GPUs and the MIG requests of pending pods);
    ``()``: free instances count nothing, only unallocated slots do (before 2026-11-29)."""
    mps_reserve_mib: int = 512
    """GPU memory kept free for the MPS server on each MPS GPU."""
    mps_thread_policy: ThreadPolicy = ThreadPolicy.PROPORTIONAL
    """How active-thread percentages are set for MPS slices."""
    placement_weight: PlacementWeight = PlacementWeight.PODS
    """What one unit of the objective's placement level is (:func:`planner.demand.pod_weights`)."""
    wait_tiers_s: tuple[float, ...] = (
        300.0,
        1800.0,
        7200.0,
        28800.0,
        57600.0,
        86400.0,
        172800.0,
        345600.0,
        691200.0,
        1382400.0,
    )
    """Waiting-time thresholds (seconds) of the objective's waiting-time level: among plans
    placing as many pods of each priority, the one placing pods past more thresholds wins
    (:func:`planner.demand.pod_weights`).  Empty: no waiting-time level.  5 min, 30 min, 2 h,
    8 h, then 16 h, 1, 2, 4, 8 and 16 days (2026-12-02; before, the last tier was 8 h): in a
    queue that lasts days every pod is past 8 h, and with one top tier a `4g` pod that waited
    four days tied with a `7g` pod that waited nine hours for a freed `7g` GPU, which churn
    then gave to the younger one (README design notes, "Waiting tiers reach past 8 h")."""
    max_candidate_nodes: int = 64
    """Per pod group, at most this many candidate nodes enter the CP-SAT model (pruning)."""
    max_model_gpus: int = 96
    """At most this many GPUs enter one CP-SAT model.  A larger snapshot is planned in rounds,
    each re-planning a neighbourhood of at most this many GPUs (fewer when the time budget is
    short) around the greedy plan, the rest keeping its decisions (:mod:`planner.neighbourhood`)."""

    def __post_init__(self) -> None:
        """Refuse settings no plan can run with (each message names the field and its range)."""
        limit = self.time_limit_s
        if not (isinstance(limit, int | float) and 0 < limit <= MAX_TIME_LIMIT_S):
            raise ValueError(
                f"planner time limit {limit!r} s: give a number above 0 and at most "
                f"{MAX_TIME_LIMIT_S:g} s"
            )
        if not (isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"planner seed {self.seed!r}: give an integer from 0 to {MAX_SEED}")
        if not (isinstance(self.num_workers, int) and self.num_workers >= 1):
            raise ValueError(f"planner num_workers {self.num_workers!r}: give an integer >= 1")
