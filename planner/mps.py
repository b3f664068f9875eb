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
is a removal plus a creation.  The batch model (:mod:`planner.mig_cpsat`) links the free
units to pod placements and puts churn and usefulness into its lexicographic objective.

Usefulness of what stays free (FGD's fragmentation measure on slice memory).  With the
target workload's slice sizes ``s_m`` and their shares ``p_m`` (:func:`mps_target`: given in
``settings.free_capacity_mps_sizes``, else learned from the snapshot: the slices in use on its
MPS GPUs and the slices its pending pods ask for), a GPU left with ``f`` MiB of usable memory
not in slices can still serve ``P(f) = sum_m p_m [s_m <= f]`` of the next pods; what it
offers them is ``f P(f)`` -- the rest, ``f (1 - P(f))``, is FGD's expected fragmentation.

In the model: one boolean ``b_a`` per GiB level ``a`` the GPU's kept and new slices can add
up to (rounded up; every level of ``[0, ceil(room / 1024)]`` when they could reach more than
256 sums), ``sum_a b_a = 1`` and ``1024 A - 1023 <= sum_j m_j keep_j + sum_s s new_s <= 1024
A`` with ``A = sum_a a b_a`` (the allocation rounded up to GiB), and ``v = sum_a T[a] b_a``
with the table ``T[a] = round(64 w_free_block f_a P(f_a) / U_g)``, ``f_a = max(0, room - 1024
a)``; ``useful = 8 w_free_gpu empty + v``.  (One-hot rather than an element constraint on an
integer ``a``: the LP relaxation then bounds ``v`` by the table; on the saturation protocol's
96-GPU models the element form made each plan ~8x slower.)  An empty GPU is worth ``8
(w_free_gpu + 8 w_free_block)``, what an empty MIG GPU is worth (:data:`USEFUL_RESOLUTION`:
MIG layouts are scored in memory slots, 8 per GPU, MPS GPUs in eighths of one).  Placing a
pod on one GPU or another then differs in how much of the free memory the expected next pods
could still use: a 10 GiB pod goes where it leaves no 5 GiB hole nobody asks for.  Without a
target (no MPS pod or slice anywhere) only ``empty`` counts.

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
from planner.snapshot import (
    GpuState,
    Mode,
    MpsSlice,
    PlannedGpu,
    PlannedSlice,
    Snapshot,
    mps_gb_of,
)

__all__ = [
    "USEFUL_RESOLUTION",
    "MpsGpuVars",
    "add_mps_gpu",
    "current_thread_percentage",
    "mps_key",
    "mps_target",
    "thread_percentage",
    "upper_bound",
    "usefulness_table",
]

USEFUL_RESOLUTION = 8
"""Units of the objective's usefulness level per unit of ``weight_free_gpu`` and
``weight_free_block``: MIG layouts score whole memory slots (:func:`planner.mig_cpsat.layout_option`),
MPS GPUs eighths of one (module docstring)."""

_GIB = 1024


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


def current_thread_percentage(s: MpsSlice, usable_mib: int, policy: ThreadPolicy) -> int:
    """Active-thread % of a slice that exists: as the snapshot gives it, else as
    :func:`thread_percentage` would set it."""
    if s.thread_percentage is not None:
        return s.thread_percentage
    return thread_percentage(s.memory_mib, usable_mib, policy)


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


def mps_target(snapshot: Snapshot, settings: PlannerSettings) -> dict[int, float]:
    """The target workload's slice sizes (MiB) and their shares (summing to 1; empty: none).

    ``settings.free_capacity_mps_sizes`` when given; else learned from the snapshot, one
    count per slice in use on an MPS GPU and per slice a pending pod asks for (the pods
    running and waiting now stand for the next ones)."""
    counts: dict[int, float] = {}
    if settings.free_capacity_mps_sizes is not None:
        for mib, weight in settings.free_capacity_mps_sizes:
            if mib > 0 and weight > 0:
                counts[mib] = counts.get(mib, 0.0) + weight
    else:
        for node in snapshot.nodes:
            if node.mode is Mode.MPS:
                for gpu in node.gpus:
                    for s in gpu.mps:
                        if s.used:
                            counts[s.memory_mib] = counts.get(s.memory_mib, 0.0) + 1
        for pod in snapshot.pods:
            for resource, units in pod.requests.items():
                gb = mps_gb_of(resource)
                if gb is not None and units > 0:
                    counts[gb * _GIB] = counts.get(gb * _GIB, 0.0) + units
    total = sum(counts.values())
    return {mib: c / total for mib, c in sorted(counts.items())} if total > 0 else {}


def usefulness_table(
    room_mib: int, usable_mib: int, target: Mapping[int, float], settings: PlannerSettings
) -> list[int]:
    """``T[a]`` of the module docstring for ``a = 0 .. ceil(room / 1024)`` GiB allocated."""
    scale = USEFUL_RESOLUTION * 8 * settings.weight_free_block
    out: list[int] = []
    for a in range(-(-room_mib // _GIB) + 1):
        free = max(0, room_mib - _GIB * a)
        share = sum(p for mib, p in target.items() if mib <= free)
        out.append(round(scale * free * share / usable_mib) if usable_mib > 0 else 0)
    return out


_LEVEL_LIMIT = 256
"""Most distinct allocations enumerated per GPU before every GiB level is offered instead."""


def _allocation_levels(
    gpu: GpuState,
    keep: list[tuple[int, cp_model.IntVar]],
    new: Mapping[int, cp_model.IntVar],
    room: int,
) -> list[int]:
    """The GiB levels ``a`` (rounded up) the GPU's free slices kept and new slices created
    can add up to, within ``room``: the one-hot choices of the usefulness table.  All levels
    ``0 .. ceil(room / 1024)`` when there are more than :data:`_LEVEL_LIMIT` sums."""
    top = -(-room // _GIB)
    items = [gpu.mps[j].memory_mib for j, _ in keep]
    for mib, var in new.items():
        items.extend([mib] * upper_bound(var))
    if all(mib % _GIB == 0 for mib in items):  # the usual case: a bit per whole GiB reached
        limit = (1 << (room // _GIB + 1)) - 1
        reach = 1
        for mib in items:
            reach |= (reach << (mib // _GIB)) & limit
        return [a for a in range(top + 1) if reach >> a & 1]
    sums = {0}
    for mib in items:
        sums |= {x + mib for x in sums if x + mib <= room}
        if len(sums) > _LEVEL_LIMIT:
            return list(range(top + 1))
    return sorted({-(-x // _GIB) for x in sums})


def add_mps_gpu(
    model: cp_model.CpModel,
    node: str,
    gpu: GpuState,
    usable_mib: int,
    max_new: Mapping[int, int],
    settings: PlannerSettings,
    target: Mapping[int, float] | None = None,
) -> MpsGpuVars:
    """Add one MPS GPU (module docstring) to ``model``.

    ``max_new`` maps each slice size (MiB) pending pods of the node ask for to the number of
    units of that size they need in total (an upper bound on useful new slices).  ``target``
    (:func:`mps_target`) values the free memory left; ``None`` or empty: only an empty GPU
    counts.
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
    alloc = cp_model.LinearExpr.weighted_sum(  # MiB the kept and new free slices take
        [*(v for _, v in keep), *new.values()],
        [*(gpu.mps[j].memory_mib for j, _ in keep), *new],
    )
    if keep or new:
        model.add(alloc <= room)
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
    useful_gpu = USEFUL_RESOLUTION * settings.weight_free_gpu
    useful: cp_model.LinearExpr = useful_gpu * empty
    useful_max = useful_gpu
    table = usefulness_table(room, usable_mib, target, settings) if target and room else []
    if table and table[0] > 0:
        useful_max += table[0]
        if keep or new:
            levels = _allocation_levels(gpu, keep, new, room)
            pick = {a: model.new_bool_var(f"alloc_gib[{tag},{a}]") for a in levels}
            model.add_exactly_one(pick.values())
            level = cp_model.LinearExpr.weighted_sum(list(pick.values()), [_GIB * a for a in pick])
            model.add(level >= alloc)
            model.add(level <= alloc + (_GIB - 1))
            useful = useful + cp_model.LinearExpr.weighted_sum(
                list(pick.values()), [table[a] for a in pick]
            )
        else:
            useful = useful + table[0]  # nothing on it can change
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
        useful_max=useful_max,
    )
