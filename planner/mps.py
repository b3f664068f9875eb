"""MPS GPUs in the CP-SAT batch model: which slices each GPU should hold.

Model (one MPS GPU ``g``)
-------------------------
Data: usable memory ``U_g`` = GPU memory - ``settings.mps_reserve_mib``; current slices, each
used or free, with memory ``m_j`` MiB; ``S_g`` = slice sizes some candidate pod of the node
asks for (``nvidia.com/gpu-<N>gb`` = ``N * 1024`` MiB), each with an upper bound ``cap_s`` on
how many new slices of that size could ever be used (pending units on the node, and
``U_g // s``).

Variables:

* ``keep_j`` in {0, 1} for every FREE current slice (used slices are kept, fixed);
* ``new_s`` in [0, cap_s] for every ``s`` in ``S_g``: slices of ``s`` MiB to create;
* ``touched`` in {0, 1}: the GPU's slice list changes;
* ``empty`` in {0, 1}: the GPU ends with no slice at all (fixed 0 if a slice is in use).

Constraints:

* memory: ``sum_{j free} m_j keep_j + sum_s s new_s <= U_g - sum_{j used} m_j``
  (clamped at 0: a GPU whose used slices already exceed ``U_g`` gets nothing new);
* ``touched >= 1 - keep_j`` for each free ``j``; ``new_s <= cap_s touched``;
* ``keep_j <= 1 - empty``; ``new_s <= cap_s (1 - empty)``.

Free units offered to pods, per size ``s``: ``sum_{j free, m_j = s} keep_j + new_s``.
Churn: ``w_destroy sum_j (1 - keep_j) + w_create sum_s new_s + w_touched touched``; a resize
is a removal plus a creation.  Usefulness of what stays free: ``w_free_gpu empty`` (a whole
GPU left for the next batch).  The batch model (:mod:`planner.mig_cpsat`) links the free
units to pod placements and puts churn and usefulness into its lexicographic objective.

Thread percentages: a kept slice keeps its own; a new slice gets its share of ``U_g``
(``round(100 m / U_g)`` clamped to 1..100, :attr:`ThreadPolicy.PROPORTIONAL`) or 100
(:attr:`ThreadPolicy.FULL`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from ortools.sat.python import cp_model

from planner.settings import PlannerSettings, ThreadPolicy
from planner.snapshot import GpuState, PlannedGpu, PlannedSlice

__all__ = ["MpsGpuVars", "add_mps_gpu", "mps_key", "thread_percentage", "upper_bound"]


def upper_bound(var: cp_model.IntVar) -> int:
    """The largest value in a CP-SAT variable's domain."""
    domain = var.proto.domain  # a protobuf repeated field: no negative indexing
    return int(domain[len(domain) - 1])


def mps_key(memory_mib: int) -> str:
    """The demand key of a slice size (matches :attr:`planner.demand.ResolvedRequest.key`)."""
    return f"mps:{memory_mib}"


def thread_percentage(memory_mib: int, usable_mib: int, policy: ThreadPolicy) -> int:
    """Active-thread % of a slice: its share of the usable memory (1..100), or 100."""
    if policy is ThreadPolicy.FULL or usable_mib <= 0:
        return 100
    return max(1, min(100, round(100 * memory_mib / usable_mib)))


@dataclass(slots=True)
class MpsGpuVars:
    """One MPS GPU's variables in the batch model, and how to read a solution back."""

    node: str
    gpu: GpuState
    usable_mib: int
    keep: list[tuple[int, cp_model.IntVar]]
    """(index into ``gpu.mps`` of a FREE current slice, its keep variable)."""
    new: dict[int, cp_model.IntVar]
    touched: cp_model.IntVar
    empty: cp_model.IntVar
    churn: cp_model.LinearExpr
    churn_max: int
    useful: cp_model.LinearExpr
    useful_max: int

    def free_units(self, memory_mib: int) -> list[tuple[int, cp_model.IntVar]]:
        """``(coefficient, variable)`` terms counting free slices of ``memory_mib`` MiB."""
        terms = [(1, v) for j, v in self.keep if self.gpu.mps[j].memory_mib == memory_mib]
        if memory_mib in self.new:
            terms.append((1, self.new[memory_mib]))
        return terms

    def free_units_max(self, memory_mib: int) -> int:
        """The most free slices of ``memory_mib`` MiB this GPU could offer."""
        kept = sum(1 for j, _ in self.keep if self.gpu.mps[j].memory_mib == memory_mib)
        new = self.new.get(memory_mib)
        return kept + (upper_bound(new) if new is not None else 0)

    def hint(self, model: cp_model.CpModel, planned: PlannedGpu | None) -> None:
        """Hint this GPU's variables from another plan's layout (``None``: unchanged)."""
        if planned is None:
            for _, v in self.keep:
                model.add_hint(v, 1)
            for v in self.new.values():
                model.add_hint(v, 0)
            return
        want: Counter[int] = Counter(s.memory_mib for s in planned.mps)
        for s in self.gpu.mps:
            if s.used:
                want[s.memory_mib] -= 1
        for j, v in self.keep:
            mib = self.gpu.mps[j].memory_mib
            keep = want[mib] > 0
            want[mib] -= keep
            model.add_hint(v, int(keep))
        for mib, v in self.new.items():
            model.add_hint(v, max(0, want[mib]))

    def decode(
        self, solver: cp_model.CpSolver, policy: ThreadPolicy
    ) -> tuple[tuple[PlannedSlice, ...], bool, list[int]]:
        """(full desired slice list, changed?, free slice sizes offered to pods)."""
        slices: list[PlannedSlice] = []
        free: list[int] = []
        kept = {j for j, v in self.keep if solver.value(v)}
        for j, s in enumerate(self.gpu.mps):
            if s.used or j in kept:
                pct = s.thread_percentage
                if pct is None:
                    pct = thread_percentage(s.memory_mib, self.usable_mib, policy)
                slices.append(PlannedSlice(s.memory_mib, pct, s.used))
                if not s.used:
                    free.append(s.memory_mib)
        created = False
        for mib in sorted(self.new, reverse=True):
            for _ in range(solver.value(self.new[mib])):
                pct = thread_percentage(mib, self.usable_mib, policy)
                slices.append(PlannedSlice(mib, pct, False))
                free.append(mib)
                created = True
        changed = created or len(kept) < len(self.keep)
        return tuple(slices), changed, free


def add_mps_gpu(
    model: cp_model.CpModel,
    node: str,
    gpu: GpuState,
    usable_mib: int,
    max_new: Mapping[int, int],
    settings: PlannerSettings,
) -> MpsGpuVars:
    """Add one MPS GPU (module docstring) to ``model``.

    ``max_new`` maps each slice size (MiB) pending pods of the node ask for to the number of
    units of that size they need in total (an upper bound on useful new slices).
    """
    used_mib = sum(s.memory_mib for s in gpu.mps if s.used)
    room = max(0, usable_mib - used_mib)
    tag = f"{node}/{gpu.index}"
    keep = [
        (j, model.new_bool_var(f"keep[{tag},{j}]")) for j, s in enumerate(gpu.mps) if not s.used
    ]
    new: dict[int, cp_model.IntVar] = {}
    for mib, units in sorted(max_new.items()):
        cap = min(units, room // mib) if mib > 0 else 0
        if cap > 0:
            new[mib] = model.new_int_var(0, cap, f"new[{tag},{mib}]")
    touched = model.new_bool_var(f"touched[{tag}]")
    empty = model.new_bool_var(f"empty[{tag}]")
    if any(s.used for s in gpu.mps):
        model.add(empty == 0)
    if keep or new:
        model.add(
            cp_model.LinearExpr.weighted_sum(
                [*(v for _, v in keep), *new.values()],
                [*(gpu.mps[j].memory_mib for j, _ in keep), *new],
            )
            <= room
        )
    for _, v in keep:
        model.add(touched >= 1 - v)
        model.add(v <= 1 - empty)
    for v in new.values():
        cap = upper_bound(v)
        model.add(v <= cap * touched)
        model.add(v <= cap * (1 - empty))
    w_d, w_c, w_t = settings.weight_destroy, settings.weight_create, settings.weight_gpu_touched
    churn = w_d * sum(1 - v for _, v in keep) + w_c * sum(new.values()) + w_t * touched
    churn_max = w_d * len(keep) + w_c * sum(upper_bound(v) for v in new.values()) + w_t
    useful = settings.weight_free_gpu * empty
    return MpsGpuVars(
        node=node,
        gpu=gpu,
        usable_mib=usable_mib,
        keep=keep,
        new=new,
        touched=touched,
        empty=empty,
        churn=churn,
        churn_max=churn_max,
        useful=useful,
        useful_max=settings.weight_free_gpu,
    )
