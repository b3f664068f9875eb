"""MPS GPUs in the CP-SAT batch model: which slices each GPU should hold.

Model (one MPS GPU ``g``)
-------------------------
Data: usable memory ``U_g`` = GPU memory - ``settings.mps_reserve_mib``; current slices, each
used or free, with memory ``m_j`` MiB; ``S_g`` = slice sizes some candidate pod of the node
asks for (``nvidia.com/gpu-<N>gb`` = ``N * 1024`` MiB), each with an upper bound ``cap_s`` on
how many new slices of that size could ever be used (pending units on the node, the room
left ``// s``, the client slots left and the thread budget left ``// t_s``: "Client limit"
below).

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
rounded DOWN (``floor(100 m / U_g)`` clamped to 1..100, :attr:`ThreadPolicy.PROPORTIONAL`),
so the slices of one GPU add up to at most 100 % as NVIDIA's plugin's ``floor(100 /
replicas)`` do; or 100 (:attr:`ThreadPolicy.FULL`, every client may use the whole GPU).

Client limit.  An MPS server accepts at most :data:`MAX_CLIENTS` (48) client contexts per
device on Volta and newer; the 49th client's CUDA init fails (``cudaErrorMpsMaxClientsReached``)
while its pod holds a slice, and NVIDIA's device plugin caps MPS replicas at 48 for that reason
(shared/facts/gpu-operator.md section 4).  Every slice is one pod's client, so:

* slices: ``sum_{j free} keep_j + sum_s new_s <= max(0, MAX_CLIENTS - #used)`` (added only
  when the variables' bounds do not imply it);
* threads (:attr:`ThreadPolicy.PROPORTIONAL` only): with ``t(m) = max(1, floor(100 m /
  U_g))`` the share of a slice of ``m`` MiB (:func:`thread_percentage`; a current slice counts
  at the share of its memory, not at a percentage it carries from elsewhere, so a snapshot's
  own percentages never keep pods off),
  ``sum_{j free} t(m_j) keep_j + sum_s t(s) new_s <= max(0, 100 - sum_{j used} t(m_j))``.
  Rounding down makes this follow from the memory constraint unless some slice is under 1 %
  of ``U_g`` (1 GiB on a GPU of more than 100 GiB, raised to the 1 % floor); it is added only
  then.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

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
    "CLIENT_LIMIT_NOTE",
    "MAX_CLIENTS",
    "THREAD_BUDGET",
    "USEFUL_RESOLUTION",
    "MpsGpuVars",
    "add_mps_gpu",
    "client_limited",
    "client_slots",
    "current_thread_percentage",
    "mps_key",
    "mps_target",
    "thread_budget",
    "thread_percentage",
    "upper_bound",
    "usefulness_table",
]

USEFUL_RESOLUTION = 8
"""Units of the objective's usefulness level per unit of ``weight_free_gpu`` and
``weight_free_block``: MIG layouts score whole memory slots (:func:`planner.mig_cpsat.layout_option`),
MPS GPUs eighths of one (module docstring)."""

MAX_CLIENTS = 48
"""Most MPS slices of one GPU (or of one hybrid host instance).  Each slice is one pod's CUDA
client of the GPU's MPS server, which accepts at most 48 client contexts per device on Volta
and newer: past that a client's CUDA init fails with ``cudaErrorMpsMaxClientsReached`` while
its pod holds the slice.  NVIDIA's device plugin caps MPS replicas at 48 per GPU for the same
reason (shared/facts/gpu-operator.md section 4, ``mps/device.go``).  (Pre-Volta GPUs take 16;
the catalog's, P100 and smaller, cannot hold more than 15 slices of 1 GiB anyway.)"""

CLIENT_LIMIT_NOTE = (
    f"; memory for it is left only on MPS GPUs or hosts at their limit of {MAX_CLIENTS} slices "
    f"(an MPS server accepts at most {MAX_CLIENTS} clients; past that CUDA init fails with "
    "cudaErrorMpsMaxClientsReached) or of 100 % active threads"
)
"""Appended to a ``capacity`` unplaced reason when the pod fits only past :data:`MAX_CLIENTS`
slices per GPU (host) or the thread budget."""

THREAD_BUDGET = 100
"""Active-thread % the slices of one GPU (host) share under :attr:`ThreadPolicy.PROPORTIONAL`."""

_GIB = 1024


def upper_bound(var: cp_model.IntVar) -> int:
    """The largest value in a CP-SAT variable's domain."""
    domain = var.proto.domain  # a protobuf repeated field: no negative indexing
    return int(domain[len(domain) - 1])


def mps_key(memory_mib: int) -> str:
    """The demand key of a slice size (matches :attr:`planner.demand.ResolvedRequest.key`)."""
    return f"mps:{memory_mib}"


def thread_percentage(memory_mib: int, usable_mib: int, policy: ThreadPolicy) -> int:
    """Active-thread % of a slice: its share of the usable memory rounded down (1..100), or
    100.  Rounding down keeps the shares of slices that fit ``usable_mib`` within 100 %."""
    if policy is ThreadPolicy.FULL or usable_mib <= 0:
        return 100
    return max(1, min(100, 100 * memory_mib // usable_mib))


def current_thread_percentage(s: MpsSlice, usable_mib: int, policy: ThreadPolicy) -> int:
    """Active-thread % of a slice that exists: as the snapshot gives it, else as
    :func:`thread_percentage` would set it."""
    if s.thread_percentage is not None:
        return s.thread_percentage
    return thread_percentage(s.memory_mib, usable_mib, policy)


def client_slots(slices: int) -> int:
    """New slices a GPU (host) holding ``slices`` slices may still get: :data:`MAX_CLIENTS`."""
    return max(0, MAX_CLIENTS - slices)


def thread_budget(percentages: Iterable[int], policy: ThreadPolicy) -> int | None:
    """Active-thread % left beside slices of thread shares ``percentages`` (clamped at 0);
    ``None`` when the policy sets no budget (:attr:`ThreadPolicy.FULL`: every slice may use the whole GPU)."""
    if policy is ThreadPolicy.FULL:
        return None
    return max(0, THREAD_BUDGET - sum(percentages))


def client_limited(
    slices: Sequence[int], usable_mib: int, memory_mib: int, policy: ThreadPolicy
) -> bool:
    """A new slice of ``memory_mib`` fits the memory of a GPU (host) of ``usable_mib`` holding
    slices of ``slices`` MiB, but not beside them: the GPU is at :data:`MAX_CLIENTS` slices or
    its thread budget (module docstring, "Client limit") lacks the slice's share."""
    if usable_mib - sum(slices) < memory_mib:
        return False
    if client_slots(len(slices)) == 0:
        return True
    left = thread_budget((thread_percentage(m, usable_mib, policy) for m in slices), policy)
    return left is not None and left < thread_percentage(memory_mib, usable_mib, policy)


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
    levels: dict[int, cp_model.IntVar] = field(default_factory=dict)
    """GiB level ``a`` -> its one-hot choice (the usefulness table's), if the GPU has one."""

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
        """Hint every variable of this GPU from another plan's layout (``None``: unchanged).

        Complete, so that CP-SAT starts from a whole solution: with the keep and new counts
        alone, the touched/empty flags and the usefulness level were left to its search, which
        on 96 MPS GPUs with a hundred distinct slice sizes found no solution in 5 s (with every
        variable hinted, the warm start is its first solution)."""
        kept: dict[int, int] = {}
        made: dict[int, int] = {}
        if planned is None:
            kept = {j: 1 for j, _ in self.keep}
        else:
            want: Counter[int] = Counter(s.memory_mib for s in planned.mps)
            for s in self.gpu.mps:
                if s.used:
                    want[s.memory_mib] -= 1
            for j, _ in self.keep:
                mib = self.gpu.mps[j].memory_mib
                kept[j] = int(want[mib] > 0)
                want[mib] -= kept[j]
            made = {mib: min(max(0, want[mib]), upper_bound(v)) for mib, v in self.new.items()}
        for j, v in self.keep:
            model.add_hint(v, kept.get(j, 0))
        for mib, v in self.new.items():
            model.add_hint(v, made.get(mib, 0))
        created = sum(made.values())
        model.add_hint(self.touched, int(created > 0 or any(k == 0 for k in kept.values())))
        anything = created > 0 or any(kept.values()) or any(s.used for s in self.gpu.mps)
        model.add_hint(self.empty, int(not anything))
        alloc = sum(self.gpu.mps[j].memory_mib for j, k in kept.items() if k)
        alloc += sum(mib * n for mib, n in made.items())
        level = -(-alloc // _GIB)
        if level in self.levels:
            for a, v in self.levels.items():
                model.add_hint(v, int(a == level))

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


def _threads_follow(
    gpu: GpuState,
    pct: Mapping[int, int],
    new_pct: Mapping[int, int],
    usable_mib: int,
    keep: Sequence[tuple[int, cp_model.IntVar]],
    new: Mapping[int, cp_model.IntVar],
) -> bool:
    """The thread budget follows from the memory constraint: no slice that is or may be on
    the GPU has more than its memory's share of the threads (``t U <= 100 m``)."""
    used = [j for j, s in enumerate(gpu.mps) if s.used]
    return (
        THREAD_BUDGET * sum(gpu.mps[j].memory_mib for j in used)
        >= usable_mib * sum(pct[j] for j in used)
        and all(pct[j] * usable_mib <= THREAD_BUDGET * gpu.mps[j].memory_mib for j, _ in keep)
        and all(new_pct[mib] * usable_mib <= THREAD_BUDGET * mib for mib in new)
    )


def add_mps_gpu(
    model: cp_model.CpModel,
    node: str,
    gpu: GpuState,
    usable_mib: int,
    max_new: Mapping[int, int],
    settings: PlannerSettings,
    target: Mapping[int, float] | None = None,
    client_limit: bool = True,
) -> MpsGpuVars:
    """Add one MPS GPU (module docstring) to ``model``.

    ``max_new`` maps each slice size (MiB) pending pods of the node ask for to the number of
    units of that size they need in total (an upper bound on useful new slices).  ``target``
    (:func:`mps_target`) values the free memory left; ``None`` or empty: only an empty GPU
    counts.  ``client_limit=False`` leaves out the client limit and thread budget (for a host
    whose slices all stay, :mod:`planner.hybrid`'s locked GPUs: nothing new comes, and one
    kept over the limit by an older plan must not make the model infeasible).
    """
    used_mib = sum(s.memory_mib for s in gpu.mps if s.used)
    room = max(0, usable_mib - used_mib)
    slots = client_slots(sum(1 for s in gpu.mps if s.used))
    if not client_limit:
        slots = len(gpu.mps) + sum(max_new.values())  # never binding
    policy = settings.mps_thread_policy
    pct = {  # thread share of every current slice's memory, and of every new size
        j: thread_percentage(s.memory_mib, usable_mib, policy) for j, s in enumerate(gpu.mps)
    }
    threads = thread_budget((pct[j] for j, s in enumerate(gpu.mps) if s.used), policy)
    if not client_limit:
        threads = None
    tag = f"{node}/{gpu.index}"
    keep = [
        (j, model.new_bool_var(f"keep[{tag},{j}]")) for j, s in enumerate(gpu.mps) if not s.used
    ]
    new: dict[int, cp_model.IntVar] = {}
    new_pct: dict[int, int] = {}
    for mib, units in sorted(max_new.items()):
        cap = min(units, room // mib, slots) if mib > 0 else 0
        new_pct[mib] = thread_percentage(mib, usable_mib, policy)
        if threads is not None:
            cap = min(cap, threads // new_pct[mib])
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
    if len(keep) + sum(upper_bound(v) for v in new.values()) > slots:  # the client limit
        model.add(sum(v for _, v in keep) + sum(new.values()) <= slots)
    if threads is not None and not _threads_follow(gpu, pct, new_pct, usable_mib, keep, new):
        model.add(
            cp_model.LinearExpr.weighted_sum(
                [*(v for _, v in keep), *new.values()],
                [*(pct[j] for j, _ in keep), *(new_pct[mib] for mib in new)],
            )
            <= threads
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
    useful_gpu = USEFUL_RESOLUTION * settings.weight_free_gpu
    useful: cp_model.LinearExpr = useful_gpu * empty
    useful_max = useful_gpu
    pick: dict[int, cp_model.IntVar] = {}
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
        levels=pick,
    )
