"""What pending pods ask for, resolved against the nodes that could serve them.

Model
-----
A pending pod requests partitionable resources (``nvidia.com/mig-<profile>: k`` or
``nvidia.com/gpu-<N>gb: k``).  All of a pod's units go to ONE node (the kube-scheduler then
picks the devices on that node), so a request is resolved *per node*, against that node's GPU
model:

* a MIG resource resolves to a :class:`~planner.catalog.MigProfile` via
  :meth:`GpuModel.profile <planner.catalog.GpuModel.profile>` (which normalises driver
  variants such as ``7g.79gb``); a MIG pod may go to ``mig`` and ``hybrid`` nodes;
* an MPS resource ``nvidia.com/gpu-<N>gb`` is one slice of ``N * 1024`` MiB; an MPS pod may go
  to ``mps`` nodes, where a GPU offers ``memory - settings.mps_reserve_mib`` MiB to slices, and
  to ``hybrid`` nodes, where a slice lives inside a MIG instance that offers its own memory
  minus the reserve (:mod:`planner.hybrid`): a unit must fit the largest profile's instance.

A pod is *eligible* for a node iff it names the node (or names none), the node's mode matches
the pod's resource kind, every requested profile exists on the node's model, every unit fits
an empty GPU of the node, the units together fit the node's GPUs if they were all empty (a
necessary count/size check, not a packing), and the node's free CPU and memory hold the pod.

Unplaced reasons (texts start with an :class:`~planner.snapshot.Unplaced` code):

* ``unknown resource: ...`` — a request that is neither a MIG nor an MPS resource, a
  non-positive count, a pod mixing MIG and MPS, or a pod without any partitionable request;
* ``more than one MPS slice: ...`` — an MPS pod asking for two slices or more
  (:func:`one_mps_slice`: a container reaches one MPS daemon, so production could not start it);
* ``exceeds any GPU of model X: ...`` — every node of the right mode rejects the pod only
  because a unit is larger than its whole GPU;
* ``no eligible node: ...`` — no node passes the eligibility test (the text lists why, per node);
* ``node cpu/memory: ...`` — nodes would fit the GPU request but lack free CPU or memory;
* ``capacity: ...`` — the pod is eligible somewhere, but the plan had no room for it.

Pod groups: pods with the same requests, CPU, memory, priority, waiting tier and eligible nodes are
interchangeable for the planner, which decides how many of each group go to each node
(:func:`group_pods`).  Priorities and waiting times become objective weights with
:func:`pod_weights`: one pod of a higher priority outweighs all pods of lower priorities
together; within a priority one more pod placed (or one more unit of GPU compute, with the
``compute`` placement weight) outweighs any difference in waiting, at any priority; among plans
placing as much of every priority the one placing longer-waiting pods wins (the waiting-time
level).

Everything here is a pure function of its arguments.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from planner.catalog import Catalog, CatalogError, GpuModel, MigProfile, UnknownGpuModel
from planner.geometry import enumerate_layouts
from planner.settings import PlacementWeight, PlannerSettings
from planner.snapshot import Mode, NodeState, PendingPod, Unplaced, mig_profile_of, mps_gb_of

__all__ = [
    "MPS_GB_PER_COMPUTE_UNIT",
    "Eligibility",
    "EligibilityIndex",
    "NodeDemand",
    "PodGroup",
    "Rejection",
    "RequestKind",
    "ResolvedRequest",
    "SnapshotError",
    "capacity_reason",
    "eligibility",
    "fits_empty_gpus",
    "group_pods",
    "mps_slice_mib",
    "mps_usable_mib",
    "node_model",
    "pod_kind",
    "pod_size",
    "pod_weights",
    "resolve_on_node",
    "wait_tier",
]

MIB_PER_GIB = 1024


class SnapshotError(ValueError):
    """The snapshot itself is unusable (unknown model, impossible current layout, ...)."""


class RequestKind(StrEnum):
    MIG = "mig"
    MPS = "mps"


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a pod cannot go to a node (or anywhere): a reason code plus human text."""

    code: Unplaced
    text: str
    model: str = ""
    """For :attr:`Unplaced.EXCEEDS_GPU`: the GPU model(s) the request exceeds."""
    wrong_mode: bool = False
    """The node is of the other partitioning mode (left out of summaries when others exist)."""

    def __str__(self) -> str:
        if self.code is Unplaced.EXCEEDS_GPU:
            return f"{self.code.value} of model {self.model}: {self.text}"
        return f"{self.code.value}: {self.text}"


@dataclass(frozen=True, slots=True)
class ResolvedRequest:
    """One of a pod's resource requests, resolved on one node's GPU model."""

    resource: str
    """The resource name as the pod spelled it (the key of its ``Assignment.gpus``)."""
    count: int
    profile: MigProfile | None = None
    """MIG: the catalog profile the name resolved to."""
    mps_mib: int = 0
    """MPS: the slice memory in MiB."""

    @property
    def key(self) -> str:
        """What a GPU must offer per unit: the profile name (MIG) or ``mps:<MiB>`` (MPS)."""
        if self.profile is not None:
            return self.profile.name
        return f"mps:{self.mps_mib}"


@dataclass(frozen=True, slots=True)
class NodeDemand:
    """A pod's whole request resolved on one node."""

    node: str
    kind: RequestKind
    requests: tuple[ResolvedRequest, ...]

    def units(self) -> dict[str, int]:
        """Units needed per key (:attr:`ResolvedRequest.key`), merging name variants."""
        out: Counter[str] = Counter()
        for r in self.requests:
            out[r.key] += r.count
        return dict(out)


@dataclass(frozen=True, slots=True)
class Eligibility:
    """The nodes a pod may go to, with its request resolved on each; or why there are none."""

    demands: Mapping[str, NodeDemand]
    """Eligible node name -> resolved demand, in node-name order."""
    reason: Rejection | None
    """Set iff ``demands`` is empty."""


def mps_slice_mib(gb: int) -> int:
    """Memory of an ``nvidia.com/gpu-<gb>gb`` slice in MiB."""
    return gb * MIB_PER_GIB


def node_model(node: NodeState, catalog: Catalog) -> GpuModel:
    """The catalog model of ``node``; :class:`SnapshotError` naming the node if unknown."""
    try:
        model = catalog.model(node.model)
    except UnknownGpuModel as e:
        raise SnapshotError(f"node {node.name}: {e}") from e
    if node.mode in (Mode.MIG, Mode.HYBRID) and not model.mig_capable:
        raise SnapshotError(
            f"node {node.name}: mode {node.mode.value} but model {model.name} does not support "
            f"MIG; label the node for MPS or fix its model"
        )
    return model


def mps_usable_mib(node: NodeState, model: GpuModel, settings: PlannerSettings) -> int:
    """GPU memory one MPS GPU of ``node`` offers to slices: total minus the server reserve."""
    total = node.gpu_memory_mib if node.gpu_memory_mib is not None else model.memory_mib
    return max(0, total - settings.mps_reserve_mib)


def one_mps_slice(requests: Mapping[str, int]) -> str | None:
    """Why a pod asking for ``requests`` cannot be served MPS slices, or ``None``: it asks for
    more than one.

    The node agent runs one MPS control daemon per GPU (per MIG instance on a hybrid node), a
    CUDA process reaches the daemon its ``CUDA_MPS_PIPE_DIRECTORY`` names, and ``Allocate``
    refuses a container slices of two daemons (:func:`node_agent.devices.container_env`).  A
    plan cannot tell which container a unit is for, and the kubelet picks each container's
    devices itself, so gpuslice serves an MPS pod one slice, as NVIDIA's device plugin serves
    MPS replicas one per request (``failRequestsGreaterThanOne``).  Before this rule the
    planners put the units of a multi-unit pod on several GPUs and the pod failed at
    admission."""
    units: list[tuple[int, int]] = []
    for resource, k in requests.items():
        gb = mps_gb_of(resource)
        if k > 0 and gb is not None and gb > 0:
            units.append((gb, k))
    n = sum(k for _, k in units)
    if n <= 1:
        return None
    total = sum(gb * k for gb, k in units)
    return (
        f"the pod asks for {n} MPS slices; a container reaches one MPS daemon (one GPU, or one "
        f"MIG instance on a hybrid node), so gpuslice gives an MPS pod one slice: ask for one "
        f"slice of the memory it needs (nvidia.com/gpu-{total}gb, if one GPU holds it), or for "
        f"MIG instances (nvidia.com/mig-<profile>) to use several GPUs"
    )


def pod_kind(pod: PendingPod) -> RequestKind | Rejection:
    """Whether ``pod`` asks for MIG or MPS slices, or why its requests are unusable."""
    kinds: set[RequestKind] = set()
    for resource, count in sorted(pod.requests.items()):
        if count < 0:
            return Rejection(
                Unplaced.UNKNOWN_RESOURCE, f"{resource} has a negative count ({count})"
            )
        if count == 0:
            continue
        gb = mps_gb_of(resource)
        if mig_profile_of(resource) is not None:
            kinds.add(RequestKind.MIG)
        elif gb is not None and gb > 0:
            kinds.add(RequestKind.MPS)
        else:
            return Rejection(
                Unplaced.UNKNOWN_RESOURCE,
                f"{resource} is neither a MIG resource (nvidia.com/mig-<profile>) nor an MPS "
                f"slice (nvidia.com/gpu-<N>gb with N >= 1)",
            )
    if not kinds:
        return Rejection(Unplaced.UNKNOWN_RESOURCE, "the pod requests no MIG or MPS resource")
    if len(kinds) > 1:
        return Rejection(
            Unplaced.UNKNOWN_RESOURCE,
            "the pod requests both MIG and MPS resources; one pod must use one kind",
        )
    kind = kinds.pop()
    if kind is RequestKind.MPS and (why := one_mps_slice(pod.requests)) is not None:
        return Rejection(Unplaced.MPS_SLICES, why)
    return kind


def _resolve_requests(
    pod: PendingPod, kind: RequestKind, node: NodeState, model: GpuModel
) -> tuple[ResolvedRequest, ...] | Rejection:
    out: list[ResolvedRequest] = []
    for resource, count in sorted(pod.requests.items()):
        if count == 0:
            continue
        if kind is RequestKind.MPS:
            gb = mps_gb_of(resource)
            assert gb is not None
            out.append(ResolvedRequest(resource, count, mps_mib=mps_slice_mib(gb)))
            continue
        name = mig_profile_of(resource)
        assert name is not None
        try:
            profile = model.profile(name)
        except CatalogError as e:
            largest = max(model.profiles, key=lambda p: (p.memory_mib, p.compute))
            if _larger_than(name, largest):
                return Rejection(
                    Unplaced.EXCEEDS_GPU,
                    f"{resource} is larger than its largest profile {largest.name}",
                    model.name,
                )
            return Rejection(Unplaced.NO_ELIGIBLE_NODE, f"node {node.name}: {e}")
        out.append(ResolvedRequest(resource, count, profile=profile))
    return tuple(out)


def _larger_than(profile_name: str, largest: MigProfile) -> bool:
    """True if ``<c>g.<m>gb`` asks for more compute or memory than ``largest`` has."""
    head = profile_name.split("+")[0]
    try:
        c_txt, m_txt = head.split(".")
        compute, mem = int(c_txt.rstrip("g")), int(m_txt.rstrip("gb"))
    except ValueError:
        return False
    return compute > largest.compute or mem > largest.memory_gb


def resolve_on_node(
    pod: PendingPod, node: NodeState, model: GpuModel, settings: PlannerSettings
) -> NodeDemand | Rejection:
    """Resolve ``pod``'s requests on ``node`` and check every eligibility rule but the name.

    ``model`` must be ``node``'s catalog model (see :func:`node_model`).
    """
    kind = pod_kind(pod)
    if isinstance(kind, Rejection):
        return kind
    want = (Mode.MIG, Mode.HYBRID) if kind is RequestKind.MIG else (Mode.MPS, Mode.HYBRID)
    if node.mode not in want:
        return Rejection(
            Unplaced.NO_ELIGIBLE_NODE,
            f"node {node.name} is in {node.mode.value} mode, the pod needs {kind.value}",
            wrong_mode=True,
        )
    if not node.gpus:
        return Rejection(Unplaced.NO_ELIGIBLE_NODE, f"node {node.name} has no GPUs")
    requests = _resolve_requests(pod, kind, node, model)
    if isinstance(requests, Rejection):
        return requests
    n_gpus = len(node.gpus)
    if kind is RequestKind.MPS:
        usable = mps_usable_mib(node, model, settings)
        where = "a GPU offers"
        if node.mode is Mode.HYBRID:
            usable = max(0, max(p.memory_mib for p in model.profiles) - settings.mps_reserve_mib)
            where = "the largest MIG instance offers"
        for r in requests:
            if r.mps_mib > usable:
                return Rejection(
                    Unplaced.EXCEEDS_GPU,
                    f"{r.resource} needs {r.mps_mib} MiB, {where} {usable} MiB to MPS "
                    f"slices (memory minus the {settings.mps_reserve_mib} MiB server reserve)",
                    model.name,
                )
        total = sum(r.mps_mib * r.count for r in requests)
        if total > usable * n_gpus:
            return Rejection(
                Unplaced.NO_ELIGIBLE_NODE,
                f"node {node.name}: {total} MiB of slices exceed its {n_gpus} GPU(s) "
                f"x {usable} MiB",
            )
    else:
        per_profile: Counter[MigProfile] = Counter()
        for r in requests:
            assert r.profile is not None
            per_profile[r.profile] += r.count
        for prof, count in per_profile.items():
            if count > prof.max_count * n_gpus:
                return Rejection(
                    Unplaced.NO_ELIGIBLE_NODE,
                    f"node {node.name}: {count} x {prof.name} exceed {n_gpus} GPU(s) "
                    f"x {prof.max_count} per GPU",
                )
        compute = sum(p.compute * c for p, c in per_profile.items())
        slots = sum(p.memory_slices * c for p, c in per_profile.items())
        if compute > model.compute_slices * n_gpus or slots > model.memory_slots * n_gpus:
            return Rejection(
                Unplaced.NO_ELIGIBLE_NODE,
                f"node {node.name}: the request needs {compute} compute / {slots} memory "
                f"slices, its {n_gpus} GPU(s) have {model.compute_slices * n_gpus} / "
                f"{model.memory_slots * n_gpus}",
            )
        if not fits_empty_gpus(model, n_gpus, per_profile):
            return Rejection(
                Unplaced.NO_ELIGIBLE_NODE,
                f"node {node.name}: no layout of its {n_gpus} empty GPU(s) holds "
                f"{', '.join(f'{c} x {p.name}' for p, c in sorted(per_profile.items(), key=lambda x: x[0].name))} "
                f"together (placement rules: at most one +me instance per GPU, instances at "
                f"fixed starts); ask for fewer or other profiles",
            )
    if pod.cpu_milli > node.cpu_milli_free or pod.memory_mib > node.memory_mib_free:
        return Rejection(
            Unplaced.NODE_RESOURCES,
            f"node {node.name} has {node.cpu_milli_free}m CPU / {node.memory_mib_free} MiB "
            f"free, the pod needs {pod.cpu_milli}m / {pod.memory_mib} MiB",
        )
    return NodeDemand(node.name, kind, requests)


_FIT_MEMO_MAX = 4096
_fit_memo: dict[tuple[int, int, tuple[tuple[str, int], ...]], tuple[GpuModel, bool]] = {}


def fits_empty_gpus(model: GpuModel, n_gpus: int, per_profile: Mapping[MigProfile, int]) -> bool:
    """Whether ``n_gpus`` empty GPUs of ``model`` can hold ``per_profile`` together: some valid
    layout per GPU (:func:`planner.geometry.enumerate_layouts`, every placement rule of
    mig.md) whose instances, summed over the GPUs, cover the request.  Counts of compute and
    memory slices are necessary, not sufficient: two ``+me`` instances never share a GPU, and
    fixed starts leave holes (A30: ``1g.6gb+me`` and ``2g.12gb+me`` never fit together).

    Exact: a search over the GPUs, each taking the count vector of one layout (restricted to
    the requested profiles; a layout holding more than is left stands for the sub-layout that
    holds what is left, valid as removing instances keeps a layout valid), memoised per
    (model, GPU count, request)."""
    profiles = sorted(per_profile, key=lambda p: p.name)
    want = tuple(per_profile[p] for p in profiles)
    key = (id(model), n_gpus, tuple((p.name, c) for p, c in zip(profiles, want, strict=True)))
    hit = _fit_memo.get(key)
    if hit is not None and hit[0] is model:
        return hit[1]
    vectors: set[tuple[int, ...]] = set()
    for layout in enumerate_layouts(model, profiles=profiles):
        counts = Counter(pl.profile.name for pl in layout)
        vectors.add(tuple(counts.get(p.name, 0) for p in profiles))
    # only the vectors no other one dominates are worth trying
    best = [
        v
        for v in vectors
        if not any(w != v and all(a >= b for a, b in zip(w, v, strict=True)) for w in vectors)
    ]
    seen: set[tuple[tuple[int, ...], int]] = set()

    def can(left: tuple[int, ...], gpus: int) -> bool:
        if not any(left):
            return True
        if gpus == 0 or (left, gpus) in seen:
            return False
        seen.add((left, gpus))
        for v in best:
            nxt = tuple(max(0, a - b) for a, b in zip(left, v, strict=True))
            if nxt != left and can(nxt, gpus - 1):
                return True
        return False

    found = can(want, n_gpus)
    if len(_fit_memo) >= _FIT_MEMO_MAX:
        _fit_memo.clear()
    _fit_memo[key] = (model, found)
    return found


def eligibility(
    pod: PendingPod,
    nodes: Sequence[NodeState],
    models: Mapping[str, GpuModel],
    settings: PlannerSettings,
) -> Eligibility:
    """Resolve ``pod`` on every node it may use; if none accepts it, the summarised reason.

    ``models`` maps node name -> catalog model (see :func:`node_model`).
    """
    kind = pod_kind(pod)
    if isinstance(kind, Rejection):
        return Eligibility({}, kind)
    named = [n for n in nodes if pod.eligible_nodes is None or n.name in pod.eligible_nodes]
    if not named:
        return Eligibility(
            {},
            Rejection(
                Unplaced.NO_ELIGIBLE_NODE,
                "none of the nodes the pod may use (nodeSelector/affinity/taints) is a "
                "partitionable GPU node in this snapshot",
            ),
        )
    demands: dict[str, NodeDemand] = {}
    rejections: list[Rejection] = []
    exceeded_models: list[str] = []
    for node in sorted(named, key=lambda n: n.name):
        got = resolve_on_node(pod, node, models[node.name], settings)
        if isinstance(got, NodeDemand):
            demands[node.name] = got
        else:
            rejections.append(got)
            if got.code is Unplaced.EXCEEDS_GPU and models[node.name].name not in exceeded_models:
                exceeded_models.append(models[node.name].name)
    if demands:
        return Eligibility(demands, None)
    return Eligibility({}, _summarise(rejections, exceeded_models))


class EligibilityIndex:
    """:func:`eligibility` for many pods over one node list, fast.

    Apart from the node name (in rejection texts) and the node's free CPU/memory,
    :func:`resolve_on_node` depends only on the pod's requests and the node's *sizing key*
    (model, mode, GPU count, ``gpu_memory_mib``).  The index groups the nodes by sizing key,
    resolves each (requests, sizing key) pair once, and then checks a node of an accepting
    class with two comparisons (CPU, memory).  Results are memoised per pod *signature*
    (requests, CPU, memory, allowed nodes).  Only a pod no node accepts takes the slow path
    (:func:`eligibility` itself, for the summarised rejection).  Same results as
    :func:`eligibility`; nothing survives the index.
    """

    def __init__(
        self,
        nodes: Sequence[NodeState],
        models: Mapping[str, GpuModel],
        settings: PlannerSettings,
    ) -> None:
        self._nodes = sorted(nodes, key=lambda n: n.name)
        self._models = models
        self._settings = settings
        classes: dict[tuple[object, ...], list[NodeState]] = defaultdict(list)
        for n in self._nodes:
            classes[(models[n.name].name, n.mode, len(n.gpus), n.gpu_memory_mib)].append(n)
        self._classes = dict(classes)
        self._resolved: dict[tuple[object, ...], tuple[ResolvedRequest, ...] | None] = {}
        self._names: dict[tuple[object, ...], list[tuple[str, tuple[ResolvedRequest, ...]]]] = {}
        self._memo: dict[tuple[object, ...], Eligibility] = {}

    def _accepting(self, pod: PendingPod) -> list[tuple[str, tuple[ResolvedRequest, ...]]]:
        """(node name, resolved requests) of every node the pod is eligible for, by name."""
        requests = tuple(sorted(pod.requests.items()))
        sig = (requests, pod.cpu_milli, pod.memory_mib, pod.eligible_nodes)
        found = self._names.get(sig)
        if found is not None:
            return found
        cpu, mem, allowed = pod.cpu_milli, pod.memory_mib, pod.eligible_nodes
        out: list[tuple[str, tuple[ResolvedRequest, ...]]] = []
        if not isinstance(pod_kind(pod), Rejection):
            for sizing, members in self._classes.items():
                key = (requests, sizing)
                if key not in self._resolved:
                    sizing_pod = PendingPod(pod.name, pod.requests)
                    node = members[0]
                    got = resolve_on_node(sizing_pod, node, self._models[node.name], self._settings)
                    self._resolved[key] = got.requests if isinstance(got, NodeDemand) else None
                resolved = self._resolved[key]
                if resolved is None:
                    continue
                out.extend(
                    (n.name, resolved)
                    for n in members
                    if cpu <= n.cpu_milli_free
                    and mem <= n.memory_mib_free
                    and (allowed is None or n.name in allowed)
                )
            if len(self._classes) > 1:
                out.sort(key=lambda e: e[0])
        self._names[sig] = out
        return out

    def eligible_names(self, pod: PendingPod) -> list[str]:
        """Names of the nodes ``pod`` is eligible for, in name order."""
        return [name for name, _ in self._accepting(pod)]

    def of(self, pod: PendingPod) -> Eligibility:
        """The pod's :class:`Eligibility`, as :func:`eligibility` computes it."""
        requests = tuple(sorted(pod.requests.items()))
        sig = (requests, pod.cpu_milli, pod.memory_mib, pod.eligible_nodes)
        found = self._memo.get(sig)
        if found is None:
            accepting = self._accepting(pod)
            if accepting:
                kind = pod_kind(pod)
                assert isinstance(kind, RequestKind)
                found = Eligibility({n: NodeDemand(n, kind, r) for n, r in accepting}, None)
            else:  # no node accepts the pod: the full rejection summary
                found = eligibility(pod, self._nodes, self._models, self._settings)
            self._memo[sig] = found
        return found


def _summarise(all_rejections: Sequence[Rejection], exceeded_models: Sequence[str]) -> Rejection:
    rejections = [r for r in all_rejections if not r.wrong_mode]
    if not rejections:
        return Rejection(
            Unplaced.NO_ELIGIBLE_NODE,
            f"none of the {len(all_rejections)} node(s) the pod may use is partitioned for "
            f"its resources ({all_rejections[0].text})",
        )
    codes = {r.code for r in rejections}
    if codes == {Unplaced.EXCEEDS_GPU}:
        texts = sorted({r.text for r in rejections})
        return Rejection(Unplaced.EXCEEDS_GPU, "; ".join(texts[:3]), ", ".join(exceeded_models))
    if codes == {Unplaced.NODE_RESOURCES}:
        return Rejection(Unplaced.NODE_RESOURCES, _first_texts(rejections, said=codes))
    return Rejection(Unplaced.NO_ELIGIBLE_NODE, _first_texts(rejections))


def _first_texts(
    rejections: Sequence[Rejection],
    limit: int = 3,
    said: Collection[Unplaced] = (Unplaced.NO_ELIGIBLE_NODE,),
) -> str:
    """The first ``limit`` rejections, each with its code unless the summary says it already
    (``said``: a CPU/memory reason read 'node cpu/memory: node cpu/memory: ...')."""
    shown = "; ".join(r.text if r.code in said else str(r) for r in rejections[:limit])
    more = len(rejections) - limit
    return shown + (f"; and {more} more node(s)" if more > 0 else "")


def capacity_reason(pod: PendingPod, eligible: Iterable[str]) -> str:
    """Unplaced text for a pod that was eligible but did not fit this plan."""
    names = sorted(eligible)
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (
        f"{Unplaced.CAPACITY.value}: no room for "
        f"{', '.join(f'{c} x {r}' for r, c in sorted(pod.requests.items()) if c)} on its "
        f"{len(names)} eligible node(s) ({shown}) without moving slices in use or displacing "
        f"pods of equal or higher priority"
    )


@dataclass(frozen=True, slots=True)
class PodGroup:
    """Interchangeable pending pods: same requests, CPU, memory, priority and eligibility."""

    pods: tuple[PendingPod, ...]
    """Members in name order; a plan that places ``k`` of them places the first ``k``."""
    demands: Mapping[str, NodeDemand]
    """Eligible node -> the (shared) resolved demand."""

    @property
    def size(self) -> int:
        return len(self.pods)

    @property
    def first(self) -> PendingPod:
        return self.pods[0]


def group_pods(
    pods: Iterable[PendingPod],
    eligibilities: Mapping[str, Eligibility],
    tiers: Sequence[float] = (),
) -> list[PodGroup]:
    """Group eligible pods by (requests, cpu, memory, priority, waiting tier, eligible nodes).

    Pods of a group come longest-waiting first (then by name), so the plan gives a group's
    places to its oldest pods; groups come in a deterministic order: priority descending, then
    first pod name.
    """
    buckets: dict[tuple[object, ...], list[PendingPod]] = defaultdict(list)
    demands: dict[tuple[object, ...], Mapping[str, NodeDemand]] = {}
    for pod in pods:
        el = eligibilities[pod.name]
        if not el.demands:
            continue
        key = (
            tuple(sorted((r, c) for r, c in pod.requests.items() if c)),
            pod.cpu_milli,
            pod.memory_mib,
            pod.priority,
            wait_tier(pod, tiers),
            tuple(el.demands),
        )
        buckets[key].append(pod)
        demands.setdefault(key, el.demands)
    groups = [
        PodGroup(tuple(sorted(members, key=lambda p: (-p.waited_s, p.name))), demands[key])
        for key, members in buckets.items()
    ]
    groups.sort(key=lambda g: (-g.first.priority, g.first.name))
    return groups


def wait_tier(pod: PendingPod, tiers: Sequence[float]) -> int:
    """How many of the waiting-time thresholds ``tiers`` (seconds) the pod has passed."""
    return sum(1 for t in tiers if pod.waited_s >= t)


_MIG_COMPUTE = re.compile(r"^(?:\d+c\.)?(?P<g>\d+)g\.")
MPS_GB_PER_COMPUTE_UNIT = 10
"""An MPS slice weighs one compute unit per started 10 GB (an eighth of an 80 GB GPU)."""


def pod_size(pod: PendingPod) -> int:
    """The pod's GPU compute in compute-slice units (the ``compute`` placement weight).

    A MIG unit weighs its profile's compute slices (``7g.80gb``: 7; a ``1c.2g.20gb`` compute
    instance: 2); an MPS slice of ``N`` GB weighs ``ceil(N / 10)``; anything else weighs 1.
    The weight is read from the resource name alone, so it is the same on every GPU model
    (profile names are per model, their compute prefix means the same everywhere).  At least 1.
    """
    total = 0
    for resource, count in pod.requests.items():
        if count <= 0:
            continue
        name = mig_profile_of(resource)
        gb = mps_gb_of(resource) if name is None else None
        m = _MIG_COMPUTE.match(name) if name is not None else None
        if m is not None:
            unit = max(1, int(m.group("g")))
        elif gb is not None and gb > 0:
            unit = -(-gb // MPS_GB_PER_COMPUTE_UNIT)
        else:
            unit = 1
        total += unit * count
    return max(1, total)


def pod_weights(
    pods: Iterable[PendingPod],
    tiers: Sequence[float] = (),
    weight: PlacementWeight = PlacementWeight.PODS,
) -> dict[str, int]:
    """Objective weight per pod: per priority, highest first, the size placed; then the waiting
    tiers of every placed pod together.

    A pod's size ``s_p`` is :func:`pod_size` (``weight`` = ``compute``) or 1 (``pods``), its
    tier ``t_p`` (:func:`wait_tier`).  With priorities ascending ``q_1 < q_2 < ...``, ``S_q`` the
    sum of the sizes of priority ``q``'s pods and ``T`` the sum of every pod's tier, every pod
    of priority ``q`` weighs ``s_p * C_q + t_p`` with ``C_{q_1} = T + 1`` and
    ``C_{q_{k+1}} = C_{q_k} * (S_{q_k} + 1)``.  By induction ``C_{q_{k+1}}`` exceeds everything
    the pods of priorities up to ``q_k`` can weigh together (sizes and every tier), so the
    objective is lexicographic: the size placed of the highest priority first, then of the
    next, ..., and only among plans that place as much of every priority, the sum of the placed
    pods' tiers.  (Until 2026-12-07 a priority's tiers sat above the sizes of the priorities
    below it: an old whole-GPU pod of priority 1 beat a new small pod of priority 1 with four
    priority-0 pods beside it, and plan() placed 1 pod where greedy placed 5.)  The order does
    not depend on which pods the weights were computed over, as long as they include every pod
    a plan places: the planners and :func:`planner.api.plan`'s comparison of plans agree.

    Either way one pod shape can lose every contest: with ``pods`` seven newer ``1g`` pods beat
    a waiting ``7g`` pod for a freed GPU, with ``compute`` a ``7g`` pod beats an older ``4g``
    pod.  ``pods`` is the default: in the openb replays at 4 nodes ``compute`` starved the
    ``4g`` pods (their median wait 1,247,379 s against 7,851 s), at 5 nodes it lost too.
    """
    by_priority: dict[int, list[PendingPod]] = defaultdict(list)
    tier: dict[str, int] = {}
    for p in pods:
        by_priority[p.priority].append(p)
        tier[p.name] = wait_tier(p, tiers)
    out: dict[str, int] = {}
    scale = sum(tier.values()) + 1
    for prio in sorted(by_priority):
        members = by_priority[prio]
        sizes = {p.name: pod_size(p) if weight is PlacementWeight.COMPUTE else 1 for p in members}
        for p in members:
            out[p.name] = sizes[p.name] * scale + tier[p.name]
        scale *= sum(sizes.values()) + 1
    return out
