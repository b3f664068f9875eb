"""Hybrid nodes: MPS slices inside MIG instances, in the CP-SAT batch model and in plans.

Rules (what a plan must obey on a ``hybrid`` node)
--------------------------------------------------
* Every GPU holds a valid MIG layout (:mod:`planner.geometry`).  An instance either is a whole
  MIG device (``nvidia.com/mig-<profile>``) or *hosts* MPS slices (``nvidia.com/gpu-<N>gb``),
  never both: its MPS daemon serves the slices, and a host is not advertised as a MIG device.
* A host instance of profile ``P`` offers ``usable(P) = memory(P) - settings.mps_reserve_mib``
  MiB (the same server reserve as a whole MPS GPU, :func:`instance_usable_mib`); its slices
  together fit that.  A new slice's active-thread % is its share of ``usable(P)`` rounded
  down (:func:`planner.mps.thread_percentage`, ``settings.mps_thread_policy``): at most 100.
* A host holds at most :data:`planner.mps.MAX_CLIENTS` (48) slices, its daemon's client limit,
  and under the proportional thread policy its slices' thread % add up to at most 100
  (:mod:`planner.mps`, "Client limit").
* Used things never move: a used instance stays where it is and hosts nothing new; a used slice
  stays in its instance, and an instance holding a used slice is *pinned* (kept like a used
  instance, :attr:`planner.snapshot.MigInstance.pinned`).  In a pinned host the free slices may
  be dropped and new slices added, within ``usable(P)``.
* A host that is used itself (:attr:`planner.snapshot.MigInstance.used` with slices: processes
  of no pod run on the instance, or it is unhealthy) is *sealed*: it stays exactly as it is,
  slices and all, nothing is added to it, and none of its free slices is offered to a pod (a
  pod given one would share the instance with those processes).  On a *locked* GPU
  (``GpuState.locked``) a pinned host keeps its slices exactly too (no new slice, none
  dropped); its free slices may still take pods.
* Pods asking for ``nvidia.com/mig-<profile>`` take whole free instances; pods asking for
  ``nvidia.com/gpu-<N>gb`` take free slices of exactly ``N`` GiB in hosts of the same node.

Model (added to :mod:`planner.mig_cpsat`'s, per hybrid node ``v``)
------------------------------------------------------------------
The MIG part is the MIG node's unchanged: GPU classes pick candidate layouts ``y_{h,l}``, which
offer ``F_P = sum f_{l,P} y_{h,l}`` free instances of each profile ``P``.  The profiles that
enter the candidate layouts (``needed``) are the MIG pods' profiles plus every profile whose
instance can hold the smallest slice size asked for on the node (:func:`host_profiles`) and
the profiles of the free hosts the node has.  Hosting is then decided per *memory class*
(the host profiles with equal ``usable(P)``, e.g. ``3g.40gb`` and ``4g.40gb``), not per
instance: every slice pattern fits every instance of a class, so free instances of one class
are interchangeable for slices, and one set of pattern variables per class (not per profile)
keeps the model free of that symmetry (on a 2-node, 40-pod benchmark it was the difference
between proving the best placement within 1 s and not):

* *patterns* ``pi`` of class ``M``: multisets of the slice sizes ``S_v`` asked for on ``v``
  (at most the units asked for per size) that fit ``usable(M)``, of at most ``MAX_CLIENTS``
  slices and (proportional threads) at most 100 thread % (:func:`patterns`), plus the slice
  multisets of ``v``'s current free hosts of the class within those limits (so keeping a host
  as it is is an option; one over them is always re-filled or dropped, its slices charged
  ``w_destroy`` as a constant).  All
  patterns when there are at most ``_PATTERN_LIMIT``, else only the maximal ones (a superset
  of slices never offers less, so the placement level stays exact unless even the maximal ones
  are more than ``_PATTERN_LIMIT``; only churn is then coarser);
* ``h_P`` in ``[0, max free P]``: free instances of profile ``P`` that become hosts (the
  host's profile is a decision);
  ``h_P + (MIG units of P placed on v) <= F_P``: a host is an instance no MIG pod gets;
  ``h_P <= F_P - L_P`` with ``L_P`` the free instances of ``P`` on *locked* GPUs
  (``GpuState.locked``: their layout stays exactly, so they host nothing new);
* ``z_{M,pi}`` in ``[0, sum_{P in M} max h_P]``: hosts of class ``M`` filled with ``pi``;
  ``sum_pi z_{M,pi} = sum_{P in M} h_P``;
* every pinned host ``j`` (an instance with a used slice) is an MPS GPU of
  :func:`planner.mps.add_mps_gpu` with ``usable(P_j)`` and its current slices: ``keep``/``new``
  variables, its memory constraint, client limit, thread budget and churn, imported unchanged
  (on a locked GPU, where its slices all stay, without the client limit and thread budget);
* free slices of size ``s`` offered on ``v``: ``sum_{M,pi} pi_s z_{M,pi} + sum_j free_j(s)``,
  which must cover the MPS units placed on ``v`` (the batch model's per-key constraint).

Churn of hosts (the batch model's middle level): ``w_create`` per slice of a chosen pattern,
less what a kept host already has (``k_{M,e} <= min(z_{M,e}, c_e)`` hosts of current pattern
``e``, ``c_e`` of them now), plus ``w_destroy`` per slice of a current free host not kept;
and a host that changes is charged like a touched GPU, as a pinned host's new slice is
(:mod:`planner.mps`): ``w_touched`` per host new or re-filled (``sum_pi z_{M,pi} - sum_e
k_{M,e}``), ``w_create`` per daemon started (``started_M >= sum_pi z_{M,pi} - c_M``,
``c_M = sum_e c_e``) and ``w_touched + w_destroy`` per daemon stopped (``stopped_M >= c_M -
sum_pi z_{M,pi}``), both ``>= 0``.  Without that charge a free whole instance became a new
host for one slice's ``w_create`` (2) while the same slice beside a used one in a pinned host
cost ``w_create + w_touched`` (10), so slices spread over free 7g instances, and each such host
went back to a whole 7g for the next 7g pod: in the hybrid time replay of the openb default
trace at 8 nodes (full trace) 460 GPUs were reconfigured against greedy's 224, with a p95 wait
of 19 s against greedy's 0 s; with it, 169 and 1 s.  It is approximate (a pattern kept in the
model may be decoded onto an instance the layout re-creates, and a GPU whose layout and hosts
both change is charged ``w_touched`` twice); placement is exact.  Usefulness is the MIG
model's.

Decoding (:meth:`HybridNodeVars.decode`): with the GPUs' decoded layouts, ``h_P`` free
instances of each ``P`` become hosts -- current hosts whose slices suit a chosen pattern
first, then the rest in (GPU index, start) order -- and the class's patterns go to them,
best-suited pairs first: a current host with exactly that pattern, then one whose free slices
include it and stay within the client limit and thread budget (kept as they are: they fit
already), then other current hosts (re-filled), then
new hosts.  Current free hosts left over
become whole MIG devices (their slices are dropped).  A GPU whose layout or hosts change is
listed in the plan with every instance and every host's slices.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from ortools.sat.python import cp_model

from planner.catalog import GpuModel, MigProfile
from planner.geometry import Layout, Placement, canonical, layout_errors
from planner.mps import (
    MAX_CLIENTS,
    THREAD_BUDGET,
    MpsGpuVars,
    add_mps_gpu,
    current_thread_percentage,
    mps_key,
    thread_budget,
    thread_percentage,
    upper_bound,
)
from planner.settings import PlannerSettings
from planner.snapshot import (
    GpuState,
    MigInstance,
    MpsSlice,
    NodeState,
    PlannedGpu,
    PlannedSlice,
)

__all__ = [
    "HybridNodeVars",
    "add_hybrid_node",
    "host_profiles",
    "hybrid_plan_errors",
    "instance_usable_mib",
    "mps_sizes",
    "needed_host_profiles",
    "patterns",
]

_PATTERN_LIMIT = 64
"""Most patterns per (node, profile) before only maximal patterns are kept."""
_MAXIMAL_SCAN = 4096
"""Most maximal patterns looked at per (node, profile) before the best are kept."""

Pattern = tuple[int, ...]
"""Slices per size, parallel to a sorted size list."""


def instance_usable_mib(profile: MigProfile, settings: PlannerSettings) -> int:
    """Memory an instance of ``profile`` offers to MPS slices: its memory minus the reserve."""
    return max(0, profile.memory_mib - settings.mps_reserve_mib)


def host_profiles(
    model: GpuModel, sizes: Iterable[int], settings: PlannerSettings
) -> frozenset[MigProfile]:
    """Profiles of ``model`` whose instance can hold at least one slice of ``sizes`` (MiB).

    Variants (``+me``, ``+gfx`` ...) are left out: each has a plain twin of the same memory
    that may start wherever it may, with at least its count, so a host of a variant can always
    be swapped for its twin and the placement level stays exact, while the candidate layouts
    (enumerated over these profiles) are about a third as many on 8-slot GPUs."""
    smallest = min(sizes, default=None)
    if smallest is None:
        return frozenset()
    return frozenset(
        p for p in model.profiles if not p.variant and instance_usable_mib(p, settings) >= smallest
    )


def mps_sizes(keys: Iterable[str]) -> dict[int, str]:
    """Slice size (MiB) -> demand key, for the MPS keys among ``keys``."""
    out: dict[int, str] = {}
    for k in keys:
        if k.startswith("mps:"):
            out[int(k.split(":", 1)[1])] = k
    return out


def needed_host_profiles(
    node: NodeState, model: GpuModel, keys: Iterable[str], settings: PlannerSettings
) -> set[str]:
    """Profile names a hybrid node's candidate layouts must count (module docstring)."""
    names = {k for k in keys if not k.startswith("mps:")}
    names |= {p.name for p in host_profiles(model, mps_sizes(keys), settings)}
    for gpu in node.gpus:
        for inst in gpu.mig:
            if inst.mps and not inst.pinned:
                names.add(model.profile(inst.profile).name)
    return names


def patterns(
    usable: int,
    sizes: Sequence[int],
    caps: Sequence[int],
    threads: Sequence[int] | None = None,
    max_slices: int = MAX_CLIENTS,
) -> list[Pattern]:
    """Non-empty multisets of ``sizes`` (at most ``caps`` each) within ``usable`` MiB, of at
    most ``max_slices`` slices (the MPS client limit) and, with ``threads`` (the thread % of a
    slice of each size), within :data:`planner.mps.THREAD_BUDGET` %.

    All of them when there are at most ``_PATTERN_LIMIT``; else the maximal ones (no slice of
    any size can be added), at most ``_PATTERN_LIMIT`` of those, most slices first (out of the
    first ``_MAXIMAL_SCAN`` found, so that many sizes cannot make the enumeration explode)."""
    n = len(sizes)
    caps = [
        min(c, usable // s, max_slices) if s > 0 else 0 for s, c in zip(sizes, caps, strict=True)
    ]
    thr = list(threads) if threads is not None else [0] * n
    budget = THREAD_BUDGET if threads is not None else 0

    def most(k: int, left: int, slots: int, pct: int) -> int:
        """Slices of size ``k`` that fit ``left`` MiB, ``slots`` and ``pct`` thread %."""
        got = min(caps[k], left // sizes[k], slots)
        return got if threads is None else min(got, pct // thr[k])

    def feasible(k: int, left: int, slots: int, pct: int) -> Iterator[tuple[int, ...]]:
        if k == n:
            yield ()
            return
        for count in range(most(k, left, slots, pct) + 1):
            for rest in feasible(
                k + 1, left - count * sizes[k], slots - count, pct - count * thr[k]
            ):
                yield (count, *rest)

    every = [
        p
        for p in itertools.islice(feasible(0, usable, max_slices, budget), _PATTERN_LIMIT + 2)
        if any(p)
    ]
    if len(every) <= _PATTERN_LIMIT:
        return every
    # maximal: choose the counts of every size but the smallest, fill the smallest, and keep
    # the result if nothing more fits
    order = sorted(range(n), key=lambda k: sizes[k])
    small, others = order[0], order[1:]

    def maximal(
        j: int, left: int, slots: int, pct: int, chosen: dict[int, int]
    ) -> Iterator[Pattern]:
        if j == len(others):
            fill = most(small, left, slots, pct)
            counts = dict(chosen)
            counts[small] = fill
            rest = left - fill * sizes[small]
            slots_rest, pct_rest = slots - fill, pct - fill * thr[small]
            if all(
                counts[k] >= caps[k] or most(k, rest, slots_rest, pct_rest) == 0 for k in range(n)
            ) and any(counts.values()):
                yield tuple(counts[k] for k in range(n))
            return
        k = others[j]
        for count in range(most(k, left, slots, pct) + 1):
            chosen[k] = count
            yield from maximal(
                j + 1, left - count * sizes[k], slots - count, pct - count * thr[k], chosen
            )
        chosen.pop(k, None)

    found = list(itertools.islice(maximal(0, usable, max_slices, budget, {}), _MAXIMAL_SCAN))
    found.sort(key=lambda p: (-sum(p), p))
    return found[:_PATTERN_LIMIT]


@lru_cache(maxsize=1024)
def _patterns_memo(
    usable: int, sizes: tuple[int, ...], caps: tuple[int, ...], threads: tuple[int, ...] | None
) -> tuple[Pattern, ...]:
    """:func:`patterns`, memoised: the hybrid nodes of a batch ask for the same classes, sizes
    and caps again and again (12 nodes of 8 A100s, 9 slice sizes: 48 enumerations of up to
    4,096 maximal patterns each, 1.2 s; 4 distinct ones, 0.1 s).  A pure function of its
    arguments, so the plan stays what it was."""
    return tuple(patterns(usable, sizes, caps, threads))


@dataclass(slots=True)
class _HostChoice:
    usable: int
    """The memory class: ``usable(P)`` of its profiles."""
    sizes: tuple[int, ...]
    pattern: Pattern
    var: cp_model.IntVar
    current: int = 0
    """Current free hosts of this class with exactly this pattern (``c_e``)."""
    kept: cp_model.IntVar | None = None


@dataclass(slots=True)
class _PinnedHost:
    gpu: int
    start: int
    vars: MpsGpuVars


@dataclass(slots=True)
class HybridNodeVars:
    """One hybrid node's host variables, and how to read a solution back."""

    node: NodeState
    model: GpuModel
    settings: PlannerSettings
    choices: list[_HostChoice] = field(default_factory=list)
    quotas: dict[str, cp_model.IntVar] = field(default_factory=dict)
    """Profile name -> ``h_P``, the free instances of ``P`` that become hosts."""
    pinned: list[_PinnedHost] = field(default_factory=list)
    churn: cp_model.LinearExpr = field(default_factory=lambda: cp_model.LinearExpr.constant(0))
    churn_max: int = 0
    host_counts: list[tuple[int, int, cp_model.IntVar, cp_model.IntVar]] = field(
        default_factory=list
    )
    """Per memory class: (usable MiB, current free hosts, hosts started, hosts stopped)."""

    def hint(self, cp: cp_model.CpModel, warm: Mapping[tuple[str, int], PlannedGpu]) -> None:
        """Hint the host variables from another plan (the greedy one): its hosts per (profile,
        pattern), its pinned hosts' slices; GPUs it does not change keep their hosts."""
        counts: Counter[tuple[int, Pattern]] = Counter()
        quotas: Counter[str] = Counter()
        pinned: dict[tuple[int, int], PlannedGpu] = {}
        sizes = {c.usable: c.sizes for c in self.choices}
        for gpu in self.node.gpus:
            planned = warm.get((self.node.name, gpu.index))
            now = {i.start: i for i in gpu.mig}
            if planned is None:
                layout = {i.start: i.profile for i in gpu.mig}
                hosts = {i.start: [s.memory_mib for s in i.mps] for i in gpu.mig if i.mps}
                planned_slices = {
                    i.start: tuple(
                        PlannedSlice(s.memory_mib, s.thread_percentage or 100, s.used)
                        for s in i.mps
                    )
                    for i in gpu.mig
                }
            else:
                layout = {st: name for name, st in planned.mig}
                hosts = {st: [s.memory_mib for s in sl] for st, sl in planned.mig_mps}
                planned_slices = dict(planned.mig_mps)
            for start, mibs in hosts.items():
                inst = now.get(start)
                if inst is not None and inst.pinned:
                    pinned[(gpu.index, start)] = PlannedGpu(
                        self.node.name, gpu.index, mps=planned_slices.get(start, ())
                    )
                    continue
                prof = self.model.profile(layout[start])
                usable = instance_usable_mib(prof, self.settings)
                if prof.name not in self.quotas or usable not in sizes:
                    continue
                have = Counter(mibs)
                pat = tuple(have.pop(sz, 0) for sz in sizes[usable])
                if not have:  # every slice is of a size the patterns know
                    counts[(usable, pat)] += 1
                    quotas[prof.name] += 1
        for c in self.choices:
            n = counts.get((c.usable, c.pattern), 0)
            cp.add_hint(c.var, min(n, upper_bound(c.var)))
            if c.kept is not None:
                cp.add_hint(c.kept, min(n, c.current))
        for name, h in self.quotas.items():
            cp.add_hint(h, min(quotas[name], upper_bound(h)))
        for usable, now_hosts, started, stopped in self.host_counts:
            total = sum(n for (u, _), n in counts.items() if u == usable)
            cp.add_hint(started, min(max(0, total - now_hosts), upper_bound(started)))
            cp.add_hint(stopped, max(0, now_hosts - total))
        for ph in self.pinned:
            ph.vars.hint(cp, pinned.get((ph.gpu, ph.start)))

    def decode(
        self,
        solver: cp_model.CpSolver,
        final: Mapping[int, Layout],
        free: dict[str, list[int]],
        settings: PlannerSettings,
    ) -> tuple[dict[int, PlannedGpu], dict[str, list[tuple[int, int]]]]:
        """The node's changed GPUs (full layouts with hosts) and, per MPS key, the
        (GPU index, host start) of each free slice; removes the hosts' instances from the
        free MIG units ``free`` (key -> GPU index per free instance).

        ``final`` maps every GPU index of the node in the model to its decoded layout."""
        policy = settings.mps_thread_policy
        gpus = {g.index: g for g in self.node.gpus}
        now: dict[tuple[int, int], MigInstance] = {
            (g.index, i.start): i for g in self.node.gpus for i in g.mig
        }
        hosts: dict[int, dict[int, tuple[PlannedSlice, ...]]] = {i: {} for i in final}
        hosted: dict[str, list[tuple[int, int]]] = {}

        def offer(gpu: int, start: int, slices: Iterable[PlannedSlice]) -> None:
            for s in slices:
                if not s.used:
                    hosted.setdefault(mps_key(s.memory_mib), []).append((gpu, start))

        for g in self.node.gpus:  # a used instance listing slices: kept as it is
            for inst in g.mig:
                if inst.used and inst.mps and g.index in hosts:
                    hosts[g.index][inst.start] = tuple(
                        PlannedSlice(s.memory_mib, s.thread_percentage or 100, s.used)
                        for s in inst.mps
                    )
        for ph in self.pinned:
            slices, _, _ = ph.vars.decode(solver, policy)
            hosts[ph.gpu][ph.start] = slices
            offer(ph.gpu, ph.start, slices)

        def current(i: int, p: Placement) -> Counter[int]:
            inst = now.get((i, p.start))
            if inst is None or self.model.profile(inst.profile) != p.profile:
                return Counter()
            return Counter(s.memory_mib for s in inst.mps)

        def rank(cur: Counter[int], want: Counter[int], usable: int) -> int:
            """How well a current host (of ``usable`` MiB) suits a pattern: 0 the same slices,
            1 more (within the client limit and thread budget), 2 other slices (re-filled),
            3 no slices (a new host)."""
            if cur and cur == want:
                return 0
            if cur and not want - cur and _within_limits(cur, usable, settings):
                return 1
            return 2 if cur else 3

        by_class: dict[int, list[_HostChoice]] = {}
        for c in self.choices:
            by_class.setdefault(c.usable, []).append(c)
        for usable_mib, choices in sorted(by_class.items()):
            wanted = [
                Counter({m: n for m, n in zip(c.sizes, c.pattern, strict=True) if n})
                for c in choices
                for _ in range(solver.value(c.var))
            ]
            names = {
                name
                for name in self.quotas
                if instance_usable_mib(self.model.profile(name), settings) == usable_mib
            }
            # the instances that become hosts: h_P of each profile, current hosts first
            chosen: list[tuple[int, Placement]] = []
            for name in sorted(names):
                cands = [
                    (i, p)
                    for i in sorted(final)
                    for p in final[i]
                    if p.profile.name == name
                    and not _pinned_now(now.get((i, p.start)), p)
                    and not gpus[i].locked
                ]
                cands.sort(
                    key=lambda ip: (
                        min((rank(current(*ip), w, usable_mib) for w in wanted), default=3),
                        ip[0],
                        ip[1].start,
                    )
                )
                need = solver.value(self.quotas[name])
                if need > len(cands):  # the model guarantees enough instances
                    raise AssertionError(f"hybrid decoding: too few free {name}")
                chosen += cands[:need]
                pool = free.get(name)
                for i, _ in cands[:need]:
                    if pool is not None and i in pool:
                        pool.remove(i)
            # patterns to the chosen instances: best-suited pairs first
            pairs = sorted(
                (rank(current(i, p), w, usable_mib), k, j)
                for k, w in enumerate(wanted)
                for j, (i, p) in enumerate(chosen)
            )
            done_w: set[int] = set()
            done_c: set[int] = set()
            for r, k, j in pairs:
                if k in done_w or j in done_c:
                    continue
                done_w.add(k)
                done_c.add(j)
                i, p = chosen[j]
                usable = instance_usable_mib(p.profile, settings)
                here = now.get((i, p.start))
                if r <= 1 and here is not None:
                    slices = tuple(
                        PlannedSlice(x.memory_mib, current_thread_percentage(x, usable, policy))
                        for x in here.mps
                    )
                else:
                    slices = tuple(
                        PlannedSlice(m, thread_percentage(m, usable, policy))
                        for m in sorted(wanted[k].elements(), reverse=True)
                    )
                hosts[i][p.start] = slices
                offer(i, p.start, slices)
            if len(done_w) != len(wanted):  # the model keeps sum z = sum h
                raise AssertionError(f"hybrid decoding: {len(wanted)} hosts, {len(chosen)} chosen")
        changed: dict[int, PlannedGpu] = {}
        for i, layout in final.items():
            before = gpus[i]
            then = {(x.start, self.model.profile(x.profile).name) for x in before.mig}
            after = {(p.start, p.profile.name) for p in layout}
            old_hosts = {
                x.start: Counter((s.memory_mib, s.thread_percentage) for s in x.mps)
                for x in before.mig
                if x.mps
            }
            new_hosts = {
                st: Counter((s.memory_mib, s.thread_percentage) for s in sl)
                for st, sl in hosts[i].items()
                if sl
            }
            if then != after or not _same_hosts(old_hosts, new_hosts):
                changed[i] = PlannedGpu(
                    self.node.name,
                    i,
                    mig=tuple((p.profile.name, p.start) for p in layout),
                    mig_mps=tuple(sorted((st, sl) for st, sl in hosts[i].items() if sl)),
                )
        for lst in hosted.values():
            lst.sort()
        return changed, hosted


def _same_hosts(
    old: Mapping[int, Counter[tuple[int, int | None]]],
    new: Mapping[int, Counter[tuple[int, int]]],
) -> bool:
    """Same slices per host; a current slice without a thread % matches any."""
    if set(old) != set(new):
        return False
    for start, have in old.items():
        want = new[start]
        if Counter(m for m, _ in have.elements()) != Counter(m for m, _ in want.elements()):
            return False
        if any(pct is not None and (m, pct) not in want for m, pct in have):
            return False
    return True


def _pinned_now(inst: MigInstance | None, p: Placement) -> bool:
    return inst is not None and inst.start == p.start and inst.pinned


def add_hybrid_node(
    cp: cp_model.CpModel,
    node: NodeState,
    model: GpuModel,
    need: Mapping[str, int],
    supply: dict[str, list[tuple[int, cp_model.IntVar]]],
    supply_max: Counter[str],
    settings: PlannerSettings,
) -> HybridNodeVars:
    """Add one hybrid node's hosts to the batch model (module docstring).

    ``need`` is the node's demand (key -> units of candidate pods), ``supply``/``supply_max``
    the node's free-unit terms and bounds, which already hold the MIG layouts' free instances
    of every profile in :func:`needed_host_profiles`; the MPS keys' terms are added here."""
    out = HybridNodeVars(node, model, settings)
    sizes_keys = mps_sizes(need)
    sizes = sorted(sizes_keys)
    caps = [need[sizes_keys[s]] for s in sizes]
    max_new = {s: need[sizes_keys[s]] for s in sizes}
    churn_terms: list[tuple[int, cp_model.IntVar]] = []
    churn_const = 0
    churn_exprs: list[cp_model.LinearExpr] = []
    w_c, w_d = settings.weight_create, settings.weight_destroy
    w_t = settings.weight_gpu_touched
    w_stop = w_t + w_d  # a host whose daemon stops: its GPU touched, its instance destroyed
    # pinned hosts: MPS GPUs of their own
    for gpu in sorted(node.gpus, key=lambda g: g.index):
        for inst in gpu.mig:
            if not inst.mps or inst.used or not inst.pinned:
                continue  # a sealed host (used itself) is kept by ``decode`` as it is
            usable = instance_usable_mib(model.profile(inst.profile), settings)
            g = add_mps_gpu(
                cp,
                node.name,
                GpuState(gpu.index, mps=inst.mps),
                usable,
                {} if gpu.locked else max_new,
                settings,
                client_limit=not gpu.locked,
            )
            if gpu.locked:  # nothing on a locked GPU is created or destroyed
                for _, keep in g.keep:
                    cp.add(keep == 1)
            out.pinned.append(_PinnedHost(gpu.index, inst.start, g))
            for s in sizes:
                supply[sizes_keys[s]].extend(g.free_units(s))
                supply_max[sizes_keys[s]] += g.free_units_max(s)
            churn_exprs.append(g.churn)
            out.churn_max += g.churn_max
    # free instances of locked GPUs (their layout is fixed, so this count is a constant)
    locked_free: Counter[str] = Counter(
        model.profile(i.profile).name for g in node.gpus if g.locked for i in g.mig if not i.pinned
    )
    # current free hosts, per memory class: their slice multisets
    existing: dict[int, Counter[tuple[tuple[int, int], ...]]] = {}
    names = {p.name for p in host_profiles(model, sizes, settings)}
    for gpu in node.gpus:
        for inst in gpu.mig:
            if inst.mps and not inst.pinned:
                prof = model.profile(inst.profile)
                names.add(prof.name)
                shape = tuple(sorted(Counter(s.memory_mib for s in inst.mps).items()))
                existing.setdefault(instance_usable_mib(prof, settings), Counter())[shape] += 1
    classes: dict[int, list[MigProfile]] = {}
    for name in sorted(names):
        prof = model.profile(name)
        classes.setdefault(instance_usable_mib(prof, settings), []).append(prof)
    for usable, profs in sorted(classes.items()):
        cur = existing.get(usable, Counter())
        destroyed_all = w_d * sum(sum(m for _, m in shape) * n for shape, n in cur.items())
        now_hosts = sum(cur.values())  # c_M
        hs: list[cp_model.IntVar] = []
        for prof in profs:
            positive = [(f, v) for f, v in supply.get(prof.name, []) if f > 0]
            ub = max(0, _free_max(positive) - locked_free[prof.name])
            if ub <= 0:
                continue
            h = cp.new_int_var(0, ub, f"hosts[{node.name},{prof.name}]")
            out.quotas[prof.name] = h
            hs.append(h)
            cp.add(  # a locked GPU keeps its layout: no new host there
                h + locked_free[prof.name]
                <= cp_model.LinearExpr.weighted_sum(
                    [v for _, v in positive], [f for f, _ in positive]
                )
            )
            supply.setdefault(prof.name, []).append((-1, h))
        all_sizes = sorted(set(sizes) | {m for shape in cur for m, _ in shape})
        options: dict[Pattern, int] = {}
        if sizes:
            threads = _threads(sizes, usable, settings)
            for pat in _patterns_memo(
                usable,
                tuple(sizes),
                tuple(
                    min(c, usable // s, MAX_CLIENTS) if s > 0 else 0
                    for s, c in zip(sizes, caps, strict=True)
                ),
                None if threads is None else tuple(threads),
            ):
                full = tuple(pat[sizes.index(s)] if s in sizes else 0 for s in all_sizes)
                options[full] = 0
        for shape, n in cur.items():
            if not _within_limits(Counter(dict(shape)), usable, settings):
                # over the client limit (an older plan): never kept as it is
                churn_const += w_d * sum(m for _, m in shape) * n
                out.churn_max += w_d * sum(m for _, m in shape) * n
                continue
            d = dict(shape)
            options[tuple(d.get(s, 0) for s in all_sizes)] = n
        if not options or not hs:
            dropped = w_stop * now_hosts
            churn_const += destroyed_all + dropped
            out.churn_max += destroyed_all + dropped
            for h in hs:
                cp.add(h == 0)
            continue
        ub = sum(upper_bound(h) for h in hs)
        zs: list[cp_model.IntVar] = []
        for pat, n_now in options.items():
            z = cp.new_int_var(0, ub, f"host[{node.name},{usable},{pat}]")
            zs.append(z)
            out.choices.append(_HostChoice(usable, tuple(all_sizes), pat, z, n_now))
            slices = sum(pat)
            for s, k in zip(all_sizes, pat, strict=True):
                if k and s in sizes_keys:
                    supply[sizes_keys[s]].append((k, z))
                    supply_max[sizes_keys[s]] += k * ub
            # its slices created, and the host touched (new or re-filled) unless kept as it is
            churn_terms.append((w_c * slices + w_t, z))
            out.churn_max += w_c * slices * ub
            if n_now:
                kept = cp.new_int_var(0, n_now, f"kept[{node.name},{usable},{pat}]")
                out.choices[-1].kept = kept
                cp.add(kept <= z)
                churn_terms.append((-(w_c + w_d) * slices - w_t, kept))
                churn_const += w_d * slices * n_now
                out.churn_max += w_d * slices * n_now
        cp.add(sum(zs) == sum(hs))
        # daemons started and stopped
        started = cp.new_int_var(0, ub, f"hosts_started[{node.name},{usable}]")
        stopped = cp.new_int_var(0, now_hosts, f"hosts_stopped[{node.name},{usable}]")
        cp.add(started >= sum(zs) - now_hosts)
        cp.add(stopped >= now_hosts - sum(zs))
        out.host_counts.append((usable, now_hosts, started, stopped))
        churn_terms.append((w_stop, stopped))
        churn_terms.append((w_c, started))
        out.churn_max += w_t * ub + w_stop * now_hosts + w_c * ub
    churn_terms.append((churn_const, cp.new_constant(1)))
    expr = cp_model.LinearExpr.weighted_sum(
        [v for _, v in churn_terms], [c for c, _ in churn_terms]
    )
    for e in churn_exprs:
        expr = expr + e
    out.churn = expr
    return out


def _threads(sizes: Sequence[int], usable: int, settings: PlannerSettings) -> list[int] | None:
    """Thread % of a new slice of each size in a host of ``usable`` MiB; ``None``: no budget."""
    policy = settings.mps_thread_policy
    if thread_budget((), policy) is None:
        return None
    return [thread_percentage(m, usable, policy) for m in sizes]


def _within_limits(slices: Counter[int], usable: int, settings: PlannerSettings) -> bool:
    """Slices of these sizes, made anew, keep a host of ``usable`` MiB within the client
    limit and thread budget (:mod:`planner.mps`)."""
    if slices.total() > MAX_CLIENTS:
        return False
    threads = _threads(sorted(slices), usable, settings)
    return (
        threads is None
        or sum(t * slices[m] for m, t in zip(sorted(slices), threads, strict=True)) <= THREAD_BUDGET
    )


def _free_max(terms: Sequence[tuple[int, cp_model.IntVar]]) -> int:
    return sum(f * upper_bound(v) for f, v in terms if f > 0)


def hybrid_plan_errors(
    node: NodeState, model: GpuModel, planned: PlannedGpu, settings: PlannerSettings
) -> list[str]:
    """What is wrong with a planned hybrid GPU: an invalid layout, a host that is not one of
    its instances or a used instance, slices beyond ``usable(P)``, more slices than
    :data:`planner.mps.MAX_CLIENTS` in a host (unless it has that many now), a pinned instance moved, a
    used slice dropped, on a locked GPU a host made or its slices changed.  Empty when the plan
    is valid (module docstring's rules)."""
    where = f"node {node.name} GPU {planned.index}"
    try:
        layout = canonical(Placement(s, model.profile(n)) for n, s in planned.mig)
    except ValueError as e:
        return [f"{where}: {e}"]
    errors = [f"{where}: {e}" for e in layout_errors(model, layout)]
    by_start = {p.start: p for p in layout}
    gpu = next((g for g in node.gpus if g.index == planned.index), None)
    now = {i.start: i for i in (gpu.mig if gpu is not None else ())}
    for inst in now.values():
        if not inst.pinned:
            continue
        p = by_start.get(inst.start)
        if p is None or p.profile != model.profile(inst.profile):
            errors.append(f"{where}: pinned instance {inst.profile}@{inst.start} moved")
    hosts = dict(planned.mig_mps)
    for start, slices in planned.mig_mps:
        p = by_start.get(start)
        if p is None:
            errors.append(f"{where}: slices in no instance (start {start})")
            continue
        was = now.get(start)
        if was is not None and was.used and not was.mps and model.profile(was.profile) == p.profile:
            errors.append(f"{where}: used instance {p} cannot host slices")
        usable = instance_usable_mib(p.profile, settings)
        total = sum(s.memory_mib for s in slices)
        if total > usable:
            errors.append(f"{where}: slices of {p} need {total} MiB > {usable} MiB usable")
        if any(not 1 <= s.thread_percentage <= 100 for s in slices):
            errors.append(f"{where}: a slice of {p} has a thread % outside 1..100")
        if len(slices) > MAX_CLIENTS and len(slices) > len(was.mps if was is not None else ()):
            errors.append(
                f"{where}: {len(slices)} slices in {p}: an MPS server takes at most "
                f"{MAX_CLIENTS} clients"
            )
    locked = gpu is not None and gpu.locked
    for start in hosts:
        was = now.get(start)
        if locked and (was is None or not was.mps):
            errors.append(f"{where}: locked GPU: new host at start {start}")
    for inst in now.values():
        if inst.mps and (inst.used or locked):
            # a sealed host, or any host of a locked GPU: its slices stay exactly
            if _slice_sizes(hosts.get(inst.start, ())) != _slice_sizes(inst.mps):
                errors.append(f"{where}: slices of kept host {inst.profile}@{inst.start} changed")
            continue
        used = Counter(s.memory_mib for s in inst.mps if s.used)
        if not used:
            continue
        kept = Counter(s.memory_mib for s in hosts.get(inst.start, ()) if s.used)
        if used - kept:
            errors.append(f"{where}: used slices of {inst.profile}@{inst.start} dropped")
    return errors


def _slice_sizes(slices: Iterable[MpsSlice | PlannedSlice]) -> Counter[int]:
    return Counter(s.memory_mib for s in slices)
