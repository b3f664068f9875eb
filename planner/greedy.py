"""The nos-like greedy baseline planner: one pass, no look-ahead, never an invalid placement.

Model
-----
This reproduces how nebuly-ai/nos plans (shared/facts/nos.md), so that the CP-SAT planner can
be compared with what users run today, minus nos's placement bugs:

1. Pending pods are sorted by priority (descending), then by the size their resource names
   state (total GB, then total compute slices: "smallest slice first"), then by name.
2. For each pod, the candidate nodes are its eligible nodes (:mod:`planner.demand`: mode,
   profiles that exist on the model, sizes that fit a GPU, CPU/memory free in the snapshot),
   in NAME order (or a given rank: :func:`plan_greedy`'s ``node_rank``).  The pod goes to
   the first candidate where it fits now; a decision is never revisited.
3. A MIG node fits the pod when the CPU/memory it has left (after the pods placed before)
   covers the pod's requests and, after claiming the node's FREE instances of the requested
   profiles (GPU index order, then start), the *lacking* profiles can be created: GPU by GPU
   in index order, among all valid layouts (:func:`planner.geometry.enumerate_layouts`) that
   keep every USED instance and every instance already claimed by this plan exactly where it
   is, the layout that *covers the most lacking profiles* is applied; free instances it does
   not keep are destroyed; a locked GPU (``GpuState.locked``) only lends its free instances.
   nos broke ties by Go map order (randomly); this planner breaks
   them deterministically: fewest instances destroyed + created, then the first layout in
   ``enumerate_layouts``' canonical order (left-to-right slot walk that leaves a slot empty
   before filling it, smaller profiles first), which puts a new instance at its rightmost
   free start: a 1g on an empty GPU goes to slot 6, keeping 0-5 for larger profiles.  A GPU
   where no layout covers anything is left alone.
4. An MPS node fits the pod when CPU/memory fit and, after claiming free slices of exactly the
   requested size, the lacking slices can be added GPU by GPU: a new slice fits where the
   GPU's memory minus ``settings.mps_reserve_mib`` minus every slice kept covers it, the GPU
   holds fewer than :data:`planner.mps.MAX_CLIENTS` (48) slices (an MPS server's client
   limit) and, under the proportional thread policy, the thread % of its slices leaves the
   new slice's share within 100; if that is not enough, free (unclaimed) slices of that GPU
   are removed, largest first, but only as many as the new slices need.  New slices get an
   active-thread percentage per ``settings.mps_thread_policy``
   (:func:`planner.mps.thread_percentage`).
5. A hybrid node (:mod:`planner.hybrid`) takes MIG pods as a MIG node does (preferring free
   instances that host no slices) and MPS pods unit by unit: a free slice of exactly the size
   in a host instance (GPU index order, then start), else a new slice in a host with room
   (``usable(P)`` minus its slices, fewer than 48 slices, thread % as in 4), else a free instance that hosts nothing becomes a host
   (the smallest profile that holds the slice), else a new instance of the smallest profile
   that holds the slice is created beside the pinned ones (the layout covering it, as in 3).
   Every instance that gets a slice of this plan is pinned from then on; a locked GPU only
   lends the free slices it has, and a sealed host (used itself) lends none.
6. A pod that fits nowhere is unplaced with :mod:`planner.demand`'s reason: its eligibility
   rejection, ``node cpu/memory`` when GPU room existed on a node whose CPU/memory the
   earlier pods took, else ``capacity`` (naming the MPS client limit when the pod would have
   fitted on some eligible node past that limit or the thread budget,
   :data:`planner.mps.CLIENT_LIMIT_NOTE`).

Unlike nos, layouts are placement-exact (profile + start), so a plan can always be applied in
full; the tentative changes for a pod are dropped when the pod does not fit the node.

Output: a :class:`~planner.snapshot.Plan` with the full desired layout of every GPU whose
layout changed, the assignments (resource -> GPU index per unit), the unplaced reasons, and
``stats``: ``placed``, ``unplaced``, ``gpus_touched``, ``instances_created``,
``instances_destroyed``.

Speed: a pod does not scan every node.  Its candidates (mode, allowed nodes, GPUs that can
ever hold its requests) are tabulated once per (requests, allowed nodes, kind), and for MIG
pods only the nodes that :mod:`planner.host_index` lists as able to host its profiles now
are visited, in visiting order (name, or the given rank); the index is updated for the one
node each placement changes.
A node whose ``capable`` set lacks a profile would be skipped by the scan anyway, so the
first fit is the same node.  A fit that failed on a node is not tried again for the same
requests until that node changes.

The per-call caches below memoise pure functions of their keys (placeable profiles beside a
pinned set, the best layout for a GPU state and lacking multiset, resolved requests per
model, failed fits per node version); they change no decision, and nothing survives the call.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from planner.catalog import Catalog, GpuModel, MigProfile, default_catalog
from planner.demand import (
    NodeDemand,
    Rejection,
    RequestKind,
    ResolvedRequest,
    capacity_reason,
    eligibility,
    mps_usable_mib,
    node_model,
    pod_kind,
    resolve_on_node,
)
from planner.geometry import (
    InvalidLayout,
    Layout,
    Placement,
    canonical,
    enumerate_layouts,
    is_valid_layout,
    layout_errors,
)
from planner.host_index import HostIndex
from planner.hybrid import host_profiles, instance_usable_mib
from planner.mps import (
    CLIENT_LIMIT_NOTE,
    MAX_CLIENTS,
    client_limited,
    client_slots,
    current_thread_percentage,
    thread_budget,
    thread_percentage,
)
from planner.settings import PlannerSettings, Policy
from planner.snapshot import (
    Assignment,
    MigInstance,
    Mode,
    NodeState,
    PendingPod,
    Plan,
    PlannedGpu,
    PlannedSlice,
    Snapshot,
    Unplaced,
)

__all__ = ["plan_greedy"]

_DEFAULT_SETTINGS = PlannerSettings()
_NAME_SIZE = re.compile(r"(?P<compute>\d+)g\.(?P<mem>\d+)gb|gpu-(?P<gb>\d+)gb")


def _pod_size(pod: PendingPod) -> tuple[int, int]:
    """(total GB, total compute slices) the pod's resource names state: smallest first."""
    gb = compute = 0
    for resource, n in pod.requests.items():
        m = _NAME_SIZE.search(resource)
        if m is None:
            continue
        if m.group("gb") is not None:
            gb += int(m.group("gb")) * n
        else:
            gb += int(m.group("mem")) * n
            compute += int(m.group("compute")) * n
    return gb, compute


# --------------------------------------------------------------------------- working state

_Key = tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class _MigGpu:
    index: int
    pinned: Layout
    """Used instances plus instances claimed by pods of this plan (never moved)."""
    free: Layout
    """Existing or planned instances no pod uses (may be destroyed)."""
    pinned_key: _Key
    free_key: _Key
    """(profile name, start) of ``pinned``/``free``: cheap cache keys."""
    locked: bool = False
    """``GpuState.locked``: free instances may be claimed, nothing created or destroyed."""
    hosts: tuple[_Host, ...] = ()
    """Hybrid: the instances (of ``pinned`` or ``free``) hosting MPS slices, by start."""


@dataclass(frozen=True, slots=True)
class _HostSlice:
    memory_mib: int
    thread_percentage: int
    used: bool
    """Used in the snapshot."""
    taken: bool
    """Used, or claimed by a pod of this plan."""


@dataclass(frozen=True, slots=True)
class _Host:
    start: int
    profile: str
    usable_mib: int
    slices: tuple[_HostSlice, ...]

    @property
    def room_mib(self) -> int:
        return self.usable_mib - sum(s.memory_mib for s in self.slices)


def _mig_gpu(
    index: int,
    pinned: Iterable[Placement],
    free: Iterable[Placement],
    locked: bool = False,
    hosts: Iterable[_Host] = (),
) -> _MigGpu:
    p, f = canonical(pinned), canonical(free)
    pk = tuple((pl.profile.name, pl.start) for pl in p)
    fk = tuple((pl.profile.name, pl.start) for pl in f)
    alive = set(pk) | set(fk)
    kept = tuple(sorted((h for h in hosts if (h.profile, h.start) in alive), key=lambda h: h.start))
    return _MigGpu(index, p, f, pk, fk, locked, kept)


@dataclass(frozen=True, slots=True)
class _Slice:
    memory_mib: int
    thread_percentage: int
    used: bool
    """Used in the snapshot (as opposed to claimed by this plan)."""


@dataclass(frozen=True, slots=True)
class _MpsGpu:
    index: int
    usable_mib: int
    pinned: tuple[_Slice, ...]
    """Used slices plus slices claimed by pods of this plan."""
    free: tuple[_Slice, ...]

    @property
    def room_mib(self) -> int:
        return self.usable_mib - sum(s.memory_mib for s in (*self.pinned, *self.free))


@dataclass(slots=True)
class _Node:
    state: NodeState
    model: GpuModel
    cpu_left: int
    mem_left: int
    mig: list[_MigGpu] = field(default_factory=list)
    mps: list[_MpsGpu] = field(default_factory=list)
    capable: frozenset[str] = frozenset()
    """Profile names free on, or placeable on some GPU of, this node now (MIG; kept current)."""
    is_mig: bool = False
    sizing_key: tuple[object, ...] = ()
    """What :func:`planner.demand.resolve_on_node` depends on, besides the pod."""
    pos: int = 0
    """Position in visiting order (:mod:`planner.host_index`)."""
    version: int = 0
    """Bumped on every commit: a fit that failed at this version fails again."""


@dataclass(slots=True)
class _Owner:
    """One requested resource of a pod while its units are being claimed."""

    resource: str
    profile: MigProfile
    left: int
    gpus: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Fit:
    """A pod's tentative placement on one node: the GPUs it changes and its units."""

    mig: tuple[_MigGpu, ...] = ()
    mps: tuple[_MpsGpu, ...] = ()
    units: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    hosts: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Hybrid MPS units: the start of each unit's host instance."""


_Resolved = tuple[tuple[ResolvedRequest, ...], frozenset[str]]
"""A pod's requests resolved on a node's model, and the MIG profile names they need."""


@dataclass(frozen=True, slots=True)
class _PodTable:
    """Where pods with one (requests, allowed nodes, kind) may go, before CPU/memory.

    ``at[pos]`` is the pod's requests resolved on the node at position ``pos`` with the MIG
    profile names they need, or ``None`` where the node is not a candidate (other mode, not
    allowed, GPUs that can never hold the requests).
    """

    at: list[_Resolved | None]
    positions: list[int]
    """Positions where ``at`` is set, ascending."""
    name_sets: frozenset[frozenset[str]]
    """The distinct profile-name sets of ``at`` (one per GPU model, usually one)."""


_ParsedGpus = dict[tuple[str, tuple[MigInstance, ...], bool], _MigGpu]


def _mig_gpus(
    node: NodeState, model: GpuModel, parsed: _ParsedGpus, settings: PlannerSettings
) -> list[_MigGpu]:
    """The node's GPUs as working state; ``parsed`` memoises identical layouts (per call)."""
    gpus: list[_MigGpu] = []
    for gpu in sorted(node.gpus, key=lambda g: g.index):
        known = parsed.get((model.name, gpu.mig, gpu.locked))
        if known is not None:
            if known.index != gpu.index:
                known = replace(known, index=gpu.index)
            gpus.append(known)
            continue
        try:
            pinned = [Placement(i.start, model.profile(i.profile)) for i in gpu.mig if i.pinned]
            free = [Placement(i.start, model.profile(i.profile)) for i in gpu.mig if not i.pinned]
            hosts = [_host_now(model, i, settings) for i in gpu.mig if i.mps]
        except ValueError as e:  # UnknownProfile
            raise InvalidLayout(f"node {node.name} GPU {gpu.index}: {e}") from e
        errors = layout_errors(model, (*pinned, *free))
        if errors:
            raise InvalidLayout(
                f"node {node.name} GPU {gpu.index}: its current MIG layout is invalid: "
                + "; ".join(errors)
            )
        gpus.append(_mig_gpu(gpu.index, pinned, free, gpu.locked, hosts))
        parsed[(model.name, gpu.mig, gpu.locked)] = gpus[-1]
    return gpus


def _host_now(model: GpuModel, inst: MigInstance, settings: PlannerSettings) -> _Host:
    """A host instance as it is now.  A sealed host (used itself, :mod:`planner.hybrid`) has
    every slice taken and no room, so no pod gets a slice of it and none is added."""
    prof = model.profile(inst.profile)
    usable = instance_usable_mib(prof, settings)
    policy = settings.mps_thread_policy
    slices = tuple(
        _HostSlice(
            s.memory_mib,
            current_thread_percentage(s, usable, policy),
            s.used,
            s.used or inst.used,
        )
        for s in inst.mps
    )
    if inst.used:
        usable = sum(s.memory_mib for s in slices)
    return _Host(inst.start, prof.name, usable, slices)


def _fits(room: int, slots: int, threads: int | None, mib: int, pct: int) -> int:
    """New slices of ``mib`` MiB (``pct`` % threads each) that fit ``room`` MiB, ``slots``
    clients and ``threads`` % (``None``: no thread budget)."""
    n = min(room // mib, slots)
    return n if threads is None else min(n, threads // pct)


def _mps_gpus(node: NodeState, model: GpuModel, settings: PlannerSettings) -> list[_MpsGpu]:
    usable = mps_usable_mib(node, model, settings)
    policy = settings.mps_thread_policy
    gpus: list[_MpsGpu] = []
    for gpu in sorted(node.gpus, key=lambda g: g.index):
        slices = [
            _Slice(
                s.memory_mib,
                current_thread_percentage(s, usable, policy),
                s.used,
            )
            for s in gpu.mps
        ]
        pinned = tuple(s for s in slices if s.used)
        free = tuple(s for s in slices if not s.used)
        gpus.append(_MpsGpu(gpu.index, usable, pinned, free))
    return gpus


# --------------------------------------------------------------------------- the planner


class _Greedy:
    def __init__(
        self,
        snapshot: Snapshot,
        settings: PlannerSettings,
        catalog: Catalog,
        node_rank: Mapping[str, float] | None = None,
    ) -> None:
        self.settings = settings
        self.snapshot = snapshot
        self._best: dict[tuple[str, _Key, _Key, _Key], Layout | None] = {}
        self._placeable: dict[tuple[str, _Key], frozenset[str]] = {}
        self._resolved: dict[tuple[object, ...], _Resolved | None] = {}
        self._tables: dict[tuple[object, ...], _PodTable] = {}
        self._failed: dict[tuple[int, tuple[tuple[str, int], ...]], int] = {}
        self._client_limited: dict[tuple[int, tuple[tuple[str, int], ...]], int] = {}
        """Like ``_failed``, where the fit would have succeeded past the MPS client limit
        (:data:`planner.mps.MAX_CLIENTS`) or thread budget."""
        self._limited = False
        """Set by an MPS fit when the client limit or thread budget kept a slice off."""
        # Why no node accepts a pod, per (requests, CPU, memory, allowed nodes): the reason
        # depends on nothing else, and the summary visits every node of the snapshot.
        self._ineligible: dict[tuple[object, ...], str] = {}
        """(node position, requests) -> the node version at which that fit failed."""
        self._initial: dict[str, list[_MigGpu]] = {}
        """Each MIG node's GPUs before planning (``layouts`` skips those still identical)."""
        parsed: _ParsedGpus = {}
        self.nodes: dict[str, _Node] = {}
        rank = node_rank or {}
        for ns in sorted(snapshot.nodes, key=lambda n: (rank.get(n.name, 0.0), n.name)):
            if ns.name in self.nodes:
                raise ValueError(
                    f"snapshot lists node {ns.name!r} twice; node names must be unique"
                )
            model = node_model(ns, catalog)
            node = _Node(ns, model, ns.cpu_milli_free, ns.memory_mib_free)
            node.is_mig = ns.mode in (Mode.MIG, Mode.HYBRID)
            node.sizing_key = (model.name, len(ns.gpus), ns.mode, ns.gpu_memory_mib)
            node.pos = len(self.nodes)
            if node.is_mig:
                node.mig = _mig_gpus(ns, model, parsed, settings)
                self._initial[ns.name] = list(node.mig)
                node.capable = self.capable(node)
            else:
                node.mps = _mps_gpus(ns, model, settings)
            self.nodes[ns.name] = node
        self.models = {name: n.model for name, n in self.nodes.items()}
        self.order = list(self.nodes.values())
        self.hosts = HostIndex([n.capable for n in self.order])

    # ---- MIG -----------------------------------------------------------------------------

    def placeable(self, model: GpuModel, gpu: _MigGpu) -> frozenset[str]:
        """Names of the profiles one more instance of which fits beside ``gpu.pinned``
        (none on a locked GPU)."""
        if gpu.locked:
            return frozenset()
        key = (model.name, gpu.pinned_key)
        found = self._placeable.get(key)
        if found is None:
            taken = {slot for pl in gpu.pinned for slot in pl.profile.span(pl.start)}
            ok: set[str] = set()
            for prof in model.profiles:
                for start in prof.starts:
                    if taken.isdisjoint(prof.span(start)) and is_valid_layout(
                        model, (*gpu.pinned, Placement(start, prof))
                    ):
                        ok.add(prof.name)
                        break
            found = frozenset(ok)
            self._placeable[key] = found
        return found

    def capable(self, node: _Node) -> frozenset[str]:
        """Profiles the node has free or could create on some GPU (a necessary condition)."""
        names: set[str] = set()
        for gpu in node.mig:
            names.update(pl.profile.name for pl in gpu.free)
            names.update(self.placeable(node.model, gpu))
        return frozenset(names)

    def best_layout(
        self, model: GpuModel, gpu: _MigGpu, lacking: Counter[MigProfile]
    ) -> Layout | None:
        """The layout covering most of ``lacking`` (tie: least churn, then canonical order)."""
        wanted = tuple(sorted((p.name, n) for p, n in lacking.items() if n > 0))
        key = (model.name, gpu.pinned_key, gpu.free_key, wanted)
        if key in self._best:
            return self._best[key]
        addable = {p for p, n in lacking.items() if n > 0} | {pl.profile for pl in gpu.free}
        pinned = set(gpu.pinned_key)
        free = set(gpu.free_key)
        best: Layout | None = None
        best_score = (0, 0)
        for layout in enumerate_layouts(model, gpu.pinned, addable):
            extra = [(pl.profile.name, pl.start) for pl in layout]
            extra = [k for k in extra if k not in pinned]
            have = Counter(name for name, _ in extra)
            covered = sum(min(n, have[name]) for name, n in wanted)
            if covered == 0:
                continue
            churn = len(free.difference(extra)) + sum(1 for k in extra if k not in free)
            score = (covered, -churn)
            if best is None or score > best_score:
                best, best_score = layout, score
        self._best[key] = best
        return best

    def fit_mig(self, node: _Node, demand: Sequence[ResolvedRequest]) -> _Fit | None:
        model = node.model
        owners = [_Owner(r.resource, r.profile, r.count) for r in demand if r.profile]
        if any(o.profile.name not in node.capable for o in owners):
            return None  # the walk below would fail too
        need: Counter[MigProfile] = Counter()
        for o in owners:
            need[o.profile] += o.left

        def claim(gpu: _MigGpu, pl: Placement) -> _MigGpu:
            owner = next(o for o in owners if o.profile == pl.profile and o.left > 0)
            owner.left -= 1
            owner.gpus.append(gpu.index)
            need[pl.profile] -= 1
            return _mig_gpu(
                gpu.index,
                (*gpu.pinned, pl),
                (f for f in gpu.free if f != pl),
                gpu.locked,
                (h for h in gpu.hosts if h.start != pl.start),  # now a whole MIG device
            )

        gpus = list(node.mig)
        changed: set[int] = set()
        # 1. Claim free instances of the requested profiles.
        for k, gpu in enumerate(gpus):
            hosting = {h.start for h in gpu.hosts}
            for pl in sorted(gpu.free, key=lambda pl: pl.start in hosting):
                if need[pl.profile] > 0:
                    gpus[k] = gpu = claim(gpu, pl)
                    changed.add(k)
        # 2. Create what is lacking, GPU by GPU.
        for k, gpu in enumerate(gpus):
            if need.total() <= 0:
                break
            placeable = self.placeable(model, gpu)
            if not any(n > 0 and p.name in placeable for p, n in need.items()):
                continue
            layout = self.best_layout(model, gpu, +need)
            if layout is None:
                continue
            pinned = set(gpu.pinned)
            extra = [pl for pl in layout if pl not in pinned]
            gpu = _mig_gpu(gpu.index, gpu.pinned, extra, gpu.locked, gpu.hosts)
            for pl in extra:
                if need[pl.profile] > 0:
                    gpu = claim(gpu, pl)
            gpus[k] = gpu
            changed.add(k)
        if need.total() > 0:
            return None
        return _Fit(
            mig=tuple(gpus[k] for k in sorted(changed)),
            units={o.resource: tuple(o.gpus) for o in owners},
        )

    # ---- hybrid: MPS slices inside MIG instances ----------------------------------------

    def fit_hybrid(
        self, node: _Node, demand: Sequence[ResolvedRequest], capped: bool = True
    ) -> _Fit | None:
        gpus = list(node.mig)
        changed: set[int] = set()
        units: dict[str, list[int]] = {r.resource: [] for r in demand}
        starts: dict[str, list[int]] = {r.resource: [] for r in demand}
        for r in demand:
            for _ in range(r.count):
                got = self._host_slice(node, gpus, r.mps_mib, capped)
                if got is None:
                    return None
                k, start = got
                changed.add(k)
                units[r.resource].append(gpus[k].index)
                starts[r.resource].append(start)
        return _Fit(
            mig=tuple(gpus[k] for k in sorted(changed)),
            units={res: tuple(ix) for res, ix in units.items()},
            hosts={res: tuple(st) for res, st in starts.items()},
        )

    def _host_slice(
        self, node: _Node, gpus: list[_MigGpu], mib: int, capped: bool = True
    ) -> tuple[int, int] | None:
        """Claim one slice of ``mib`` MiB on ``gpus`` (module docstring, rule 5): (position in
        ``gpus``, host start), ``gpus`` updated; ``None`` if there is no room.  A host takes a
        new slice only within the client limit and thread budget (``capped=False``: lifted)."""
        model, settings = node.model, self.settings
        policy = settings.mps_thread_policy

        def put(k: int, host: _Host, start: int) -> tuple[int, int]:
            gpu = gpus[k]
            pl = next(p for p in (*gpu.pinned, *gpu.free) if p.start == start)
            pinned = gpu.pinned if pl in gpu.pinned else (*gpu.pinned, pl)
            hosts = [h for h in gpu.hosts if h.start != start] + [host]
            gpus[k] = _mig_gpu(
                gpu.index, pinned, (f for f in gpu.free if f != pl), gpu.locked, hosts
            )
            return k, start

        for k, gpu in enumerate(gpus):  # a free slice of this size (a client within the limit)
            for h in gpu.hosts:
                if capped and sum(x.taken for x in h.slices) >= MAX_CLIENTS:
                    continue
                for j, sl in enumerate(h.slices):
                    if not sl.taken and sl.memory_mib == mib:
                        new = (*h.slices[:j], replace(sl, taken=True), *h.slices[j + 1 :])
                        return put(k, replace(h, slices=new), h.start)
        for k, gpu in enumerate(gpus):  # room in a host
            for h in () if gpu.locked else gpu.hosts:
                if h.room_mib >= mib:
                    pct = thread_percentage(mib, h.usable_mib, policy)
                    if capped and client_limited(
                        [x.memory_mib for x in h.slices],
                        h.usable_mib,
                        mib,
                        policy,
                    ):
                        self._limited = True
                        continue
                    new = (*h.slices, _HostSlice(mib, pct, False, True))
                    return put(k, replace(h, slices=new), h.start)
        fitting = sorted(
            host_profiles(model, (mib,), settings), key=lambda p: (p.memory_mib, p.compute, p.name)
        )
        best: tuple[int, int, int, int] | None = None  # (memory, k, start, profile index)
        for k, gpu in enumerate(gpus):  # a free instance hosting nothing
            hosting = {h.start for h in gpu.hosts}
            for pl in () if gpu.locked else gpu.free:
                if pl.start not in hosting and pl.profile in fitting:
                    cand = (pl.profile.memory_mib, k, pl.start, fitting.index(pl.profile))
                    best = cand if best is None or cand < best else best
        if best is None:
            for prof in fitting:  # a new instance
                for k, gpu in enumerate(gpus):
                    if prof.name not in self.placeable(model, gpu):
                        continue
                    layout = self.best_layout(model, gpu, Counter({prof: 1}))
                    if layout is None:
                        continue
                    pinned = set(gpu.pinned)
                    hosting = {h.start for h in gpu.hosts}
                    extra = [pl for pl in layout if pl not in pinned]
                    new_gpu = _mig_gpu(gpu.index, gpu.pinned, extra, gpu.locked, gpu.hosts)
                    pick = next(
                        (pl for pl in extra if pl.profile == prof and pl.start not in hosting),
                        None,
                    )
                    if pick is None:
                        continue
                    gpus[k] = new_gpu
                    best = (prof.memory_mib, k, pick.start, fitting.index(prof))
                    break
                if best is not None:
                    break
        if best is None:
            return None
        _, k, start, pi = best
        prof = fitting[pi]
        usable = instance_usable_mib(prof, settings)
        sl = _HostSlice(mib, thread_percentage(mib, usable, policy), False, True)
        return put(k, _Host(start, prof.name, usable, (sl,)), start)

    # ---- MPS -----------------------------------------------------------------------------

    def fit_mps(
        self, node: _Node, demand: Sequence[ResolvedRequest], capped: bool = True
    ) -> _Fit | None:
        """Claim the pod's MPS slices on ``node`` (module docstring, rule 4); ``capped=False``
        lifts the client limit and thread budget (only to tell why a pod did not fit)."""
        policy = self.settings.mps_thread_policy
        gpus = list(node.mps)
        changed: set[int] = set()
        units: dict[str, list[int]] = {r.resource: [] for r in demand}
        for r in demand:
            mib, need = r.mps_mib, r.count
            # 1. Claim free slices of exactly this size.
            for k, gpu in enumerate(gpus):
                free = list(gpu.free)
                pinned = list(gpu.pinned)
                for s in gpu.free:
                    if (
                        need > 0
                        and s.memory_mib == mib
                        and (len(pinned) < MAX_CLIENTS or not capped)
                    ):
                        free.remove(s)
                        pinned.append(s)
                        units[r.resource].append(gpu.index)
                        need -= 1
                if len(free) != len(gpu.free):
                    gpus[k] = replace(gpu, pinned=tuple(pinned), free=tuple(free))
                    changed.add(k)
            # 2. Add slices where memory, client slots and threads allow, removing free slices
            #    (largest first) if needed.
            for k, gpu in enumerate(gpus):
                if need == 0:
                    break
                pct = thread_percentage(mib, gpu.usable_mib, policy)
                room = gpu.room_mib
                slots, threads = need, None
                if capped:
                    have = (*gpu.pinned, *gpu.free)
                    slots = client_slots(len(have))
                    threads = thread_budget(
                        (thread_percentage(s.memory_mib, gpu.usable_mib, policy) for s in have),
                        policy,
                    )
                drop_order = sorted(gpu.free, key=lambda s: -s.memory_mib)
                n_drop = 0
                while _fits(room, slots, threads, mib, pct) < need and n_drop < len(drop_order):
                    d = drop_order[n_drop]
                    room, slots = room + d.memory_mib, slots + 1
                    if threads is not None:
                        threads += thread_percentage(d.memory_mib, gpu.usable_mib, policy)
                    n_drop += 1
                add = min(need, _fits(room, slots, threads, mib, pct))
                while n_drop > 0:
                    d = drop_order[n_drop - 1]
                    t = threads
                    if t is not None:
                        t -= thread_percentage(d.memory_mib, gpu.usable_mib, policy)
                    if _fits(room - d.memory_mib, slots - 1, t, mib, pct) < add:
                        break
                    n_drop -= 1  # that removal was not needed for ``add`` slices
                    room, slots, threads = room - d.memory_mib, slots - 1, t
                if add < need and min(need, room // mib) > add:
                    self._limited = True  # the client limit (or thread budget) kept slices off
                if add == 0:
                    continue
                kept = list(gpu.free)
                for dropped in drop_order[:n_drop]:
                    kept.remove(dropped)
                new = tuple(_Slice(mib, pct, used=False) for _ in range(add))
                gpus[k] = replace(gpu, pinned=(*gpu.pinned, *new), free=tuple(kept))
                units[r.resource].extend([gpu.index] * add)
                changed.add(k)
                need -= add
            if need > 0:
                return None
        return _Fit(
            mps=tuple(gpus[k] for k in sorted(changed)),
            units={res: tuple(ix) for res, ix in units.items()},
        )

    # ---- pods ----------------------------------------------------------------------------

    def resolved(
        self, node: _Node, requests: tuple[tuple[str, int], ...], sizing_pod: PendingPod
    ) -> _Resolved | None:
        """The pod's requests on the node's GPUs per :func:`planner.demand.resolve_on_node`,
        with the MIG profile names they need; ``None`` if the node's GPUs can never hold them.

        ``sizing_pod`` is the pod without CPU/memory: the result then depends only on the
        node's ``sizing_key``, which is what the cache key holds.
        """
        key = (node.sizing_key, requests)
        if key not in self._resolved:
            got = resolve_on_node(sizing_pod, node.state, node.model, self.settings)
            self._resolved[key] = (
                (got.requests, frozenset(r.profile.name for r in got.requests if r.profile))
                if isinstance(got, NodeDemand)
                else None
            )
        return self._resolved[key]

    def table(
        self, pod: PendingPod, requests: tuple[tuple[str, int], ...], kind: RequestKind
    ) -> _PodTable:
        """The :class:`_PodTable` of the pod's (requests, allowed nodes, kind), memoised."""
        key = (requests, pod.eligible_nodes, kind)
        found = self._tables.get(key)
        if found is None:
            sizing_pod = replace(pod, cpu_milli=0, memory_mib=0)
            at: list[_Resolved | None] = [None] * len(self.order)
            positions: list[int] = []
            want_mig, allowed = kind is RequestKind.MIG, pod.eligible_nodes
            for node in self.order:
                hybrid = node.state.mode is Mode.HYBRID
                if (node.is_mig != want_mig and not hybrid) or (
                    allowed is not None and node.state.name not in allowed
                ):
                    continue
                got = self.resolved(node, requests, sizing_pod)
                if got is not None:
                    at[node.pos] = got
                    positions.append(node.pos)
            name_sets = frozenset(got[1] for got in at if got is not None)
            found = self._tables[key] = _PodTable(at, positions, name_sets)
        return found

    def fit(
        self, node: _Node, demand: Sequence[ResolvedRequest], capped: bool = True
    ) -> _Fit | None:
        if node.is_mig and demand and demand[0].profile is None:
            return self.fit_hybrid(node, demand, capped)
        if node.is_mig:
            return self.fit_mig(node, demand)
        return self.fit_mps(node, demand, capped)

    def fit_once(
        self, node: _Node, requests: tuple[tuple[str, int], ...], demand: Sequence[ResolvedRequest]
    ) -> _Fit | None:
        """:meth:`fit`, skipped where it failed for these requests since the node's last change."""
        key = (node.pos, requests)
        if self._failed.get(key) == node.version:
            return None
        self._limited = False
        fit = self.fit(node, demand)
        if fit is None:
            self._failed[key] = node.version
            if self._limited and self.fit(node, demand, capped=False) is not None:
                self._client_limited[key] = node.version
        return fit

    def commit(self, node: _Node, pod: PendingPod, fit: _Fit) -> None:
        node.cpu_left -= pod.cpu_milli
        node.mem_left -= pod.memory_mib
        node.version += 1
        for g in fit.mig:
            node.mig[next(i for i, x in enumerate(node.mig) if x.index == g.index)] = g
        if fit.mig:
            before, node.capable = node.capable, self.capable(node)
            if before != node.capable:
                self.hosts.update(node.pos, before, node.capable)
        for s in fit.mps:
            node.mps[next(i for i, x in enumerate(node.mps) if x.index == s.index)] = s

    def ineligible(self, pod: PendingPod, requests: tuple[tuple[str, int], ...]) -> str:
        """Why no node accepts ``pod`` (:func:`planner.demand.eligibility`'s summary), memoised:
        it reads only the pod's requests, CPU, memory and allowed nodes, and the snapshot's
        nodes as they were (not what this plan placed on them)."""
        key = (requests, pod.cpu_milli, pod.memory_mib, pod.eligible_nodes)
        found = self._ineligible.get(key)
        if found is None:
            el = eligibility(pod, self.snapshot.nodes, self.models, self.settings)
            found = str(el.reason) if el.reason is not None else capacity_reason(pod, ())
            self._ineligible[key] = found
        return found

    def place(self, pod: PendingPod) -> Assignment | str:
        """Place one pod on the first candidate node it fits; else the unplaced reason.

        The nodes visited are the pod's candidates (:meth:`table`) among those the host
        index lists as able to host its profiles (MIG), in visiting order: the same first fit
        as a scan of every candidate, without visiting the nodes already full for it.
        """
        kind = pod_kind(pod)
        if isinstance(kind, Rejection):
            return str(kind)
        requests = tuple(sorted((r, c) for r, c in pod.requests.items() if c))
        cpu, mem = pod.cpu_milli, pod.memory_mib
        table = self.table(pod, requests, kind)
        at, order = table.at, self.order
        visit: Sequence[int] = table.positions
        if kind is RequestKind.MIG and table.name_sets:
            visit = self.hosts.covering(table.name_sets)
        short: list[tuple[_Node, tuple[ResolvedRequest, ...]]] = []
        # The hot loop of the planner: keep it lean.
        for pos in visit:
            got = at[pos]
            if got is None:
                continue  # not a candidate of this pod
            node = order[pos]
            ns = node.state
            if cpu > ns.cpu_milli_free or mem > ns.memory_mib_free:
                continue  # not eligible (planner.demand): the node is too small anyway
            demand, names = got
            if not names <= node.capable:
                continue
            if cpu > node.cpu_left or mem > node.mem_left:
                short.append((node, demand))
                continue
            fit = self.fit_once(node, requests, demand)
            if fit is not None:
                self.commit(node, pod, fit)
                if fit.hosts:
                    return Assignment(ns.name, dict(fit.units), dict(fit.hosts))
                return Assignment(ns.name, dict(fit.units))
        eligible = [
            order[pos].state.name
            for pos in table.positions
            if cpu <= order[pos].state.cpu_milli_free and mem <= order[pos].state.memory_mib_free
        ]
        if not eligible:
            return self.ineligible(pod, requests)
        if any(self.fit_once(node, requests, demand) is not None for node, demand in short):
            return (
                f"{Unplaced.NODE_RESOURCES.value}: GPU room for the pod exists, but the pods "
                f"placed before it took the CPU/memory it needs ({cpu}m / {mem} MiB) on every "
                "such node"
            )
        limited = self._client_limited
        if limited and any(
            limited.get((pos, requests), -1) == order[pos].version for pos in table.positions
        ):
            return capacity_reason(pod, eligible) + CLIENT_LIMIT_NOTE
        return capacity_reason(pod, eligible)

    # ---- output --------------------------------------------------------------------------

    def layouts(self) -> tuple[dict[tuple[str, int], PlannedGpu], Counter[str]]:
        """Desired layouts of the changed GPUs, and the churn counts."""
        out: dict[tuple[str, int], PlannedGpu] = {}
        churn: Counter[str] = Counter()
        for name, node in self.nodes.items():
            before = {g.index: g for g in node.state.gpus}
            initial = self._initial.get(name, [])
            for k, mg in enumerate(node.mig):
                if k < len(initial) and mg is initial[k]:
                    continue  # never touched by this plan
                now = canonical((*mg.pinned, *mg.free))
                then = Counter(
                    (node.model.profile(i.profile).name, i.start) for i in before[mg.index].mig
                )
                after = Counter((pl.profile.name, pl.start) for pl in now)
                hosts_then = {
                    i.start: sorted(s.memory_mib for s in i.mps)
                    for i in before[mg.index].mig
                    if i.mps
                }
                hosts_after = {
                    h.start: sorted(s.memory_mib for s in h.slices) for h in mg.hosts if h.slices
                }
                if then != after or hosts_then != hosts_after:
                    out[(name, mg.index)] = PlannedGpu(
                        name,
                        mg.index,
                        mig=tuple((pl.profile.name, pl.start) for pl in now),
                        mig_mps=tuple(
                            (
                                h.start,
                                tuple(
                                    PlannedSlice(s.memory_mib, s.thread_percentage, s.used)
                                    for s in h.slices
                                ),
                            )
                            for h in mg.hosts
                            if h.slices
                        ),
                    )
                    churn["gpus_touched"] += 1
                    churn["instances_created"] += (after - then).total()
                    churn["instances_destroyed"] += (then - after).total()
            for sg in node.mps:
                mps_then = Counter(s.memory_mib for s in before[sg.index].mps)
                slices = sorted((*sg.pinned, *sg.free), key=lambda s: (not s.used, -s.memory_mib))
                mps_after = Counter(s.memory_mib for s in slices)
                if mps_then != mps_after:
                    out[(name, sg.index)] = PlannedGpu(
                        name,
                        sg.index,
                        mps=tuple(
                            PlannedSlice(s.memory_mib, s.thread_percentage, s.used) for s in slices
                        ),
                    )
                    churn["gpus_touched"] += 1
                    churn["instances_created"] += (mps_after - mps_then).total()
                    churn["instances_destroyed"] += (mps_then - mps_after).total()
        return out, churn


def plan_greedy(
    snapshot: Snapshot,
    settings: PlannerSettings = _DEFAULT_SETTINGS,
    catalog: Catalog | None = None,
    node_rank: Mapping[str, float] | None = None,
) -> Plan:
    """Plan ``snapshot`` the way nos does, with placement-exact layouts (module docstring).

    ``node_rank`` replaces nos's name order of step 2: nodes are visited by rank ascending,
    then name (the CP-SAT planner's warm start on a large snapshot ranks by spare capacity,
    best fit first: :mod:`planner.api`).  ``None``: name order, as nos."""
    dup = [n for n, c in Counter(p.name for p in snapshot.pods).items() if c > 1]
    if dup:
        raise ValueError(f"snapshot lists pending pod(s) {dup} twice; pod names must be unique")
    greedy = _Greedy(snapshot, settings, catalog or default_catalog(), node_rank)
    assignments: dict[str, Assignment] = {}
    unplaced: dict[str, str] = {}
    for pod in sorted(snapshot.pods, key=lambda p: (-p.priority, _pod_size(p), p.name)):
        got = greedy.place(pod)
        if isinstance(got, Assignment):
            assignments[pod.name] = got
        else:
            unplaced[pod.name] = got
    layouts, churn = greedy.layouts()
    stats: dict[str, float] = {
        "placed": float(len(assignments)),
        "unplaced": float(len(unplaced)),
        "gpus_touched": float(churn["gpus_touched"]),
        "instances_created": float(churn["instances_created"]),
        "instances_destroyed": float(churn["instances_destroyed"]),
    }
    return Plan(
        layouts=layouts,
        assignments=assignments,
        unplaced=unplaced,
        policy=Policy.GREEDY.value,
        status="GREEDY",
        stats=stats,
    )
