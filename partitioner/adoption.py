"""A node's GPUs as they are now: from its agent's report, else adopted from what the cluster shows. Pure.

Model
-----
Once gpuslice's node agent has reported (``NodePartitioning.status.gpus``, read through NVML
and the kubelet), that report *is* the node: every instance with its start and whether a pod
holds it (:func:`gpus_from_status`); its GPU count wins over a count from labels under GFD's
``single`` strategy, where the labels' count is a guess (:func:`adopt`).  Before that --
gpuslice just installed, the what-if run on a dump of a cluster without it, a node migrating
from nos, mig-parted or the GPU Operator's MIG manager -- :func:`adopt` derives the GPUs from
what the API shows:

* **instances per profile** (``T``): nos's status annotations
  ``nos.nebuly.com/status-gpu-<i>-<profile>-<free|used>`` (per GPU), else GPU Feature
  Discovery's labels (:mod:`partitioner.node_labels`: ``mig-<profile>.count`` under ``mixed``,
  the MIG devices under ``single``), else the node's ``status.capacity`` of
  ``nvidia.com/mig-<profile>`` (NVIDIA's device plugin).  nos's annotations must agree with
  GFD's labels where both exist (they go stale once nos is gone);
* **instances in use** (``U``): the requests of the pods bound to the node that have not
  finished: ``nvidia.com/mig-<profile>``, and under ``single`` ``nvidia.com/gpu`` (each unit
  one MIG device); a whole-GPU ``nvidia.com/gpu`` elsewhere holds a GPU (MIG off), which GPU
  unknown.  ``U <= T`` for every profile, else the readings disagree;
* **instances per GPU**: nos gives them per GPU index.  Otherwise the node-level counts are
  spread over the GPUs: every way of splitting ``T`` into per-GPU multisets that valid layouts
  can hold (:mod:`planner.geometry`) is searched (stopping at two, with a step budget).  One
  split with the same multiset on every GPU is known exactly (e.g. 14 x 1g.10gb on two
  A100-80GB: 7 + 7); so is the MIG manager's applied ``all-<profile>`` config when it matches
  ``T``.  Otherwise the first split found is used, and which GPU index holds what is unknown;
* **places**: a multiset that only one valid layout holds (7 x 1g, 2 x 3g, 4g + 3g) has known
  starts; otherwise the first valid layout is used.

A GPU is **locked** (``GpuState.locked``: the plan keeps it as it is, its free instances still
take pods) when it may hold an instance in use and its index, its starts or which of its
instances are used is not known exactly: planning a change there would ask the agent to move
an instance a pod holds, which it refuses (``Degraded``).  A GPU that holds nothing in use is
never locked -- reshaping it is safe whatever its exact layout.  A node the readings cannot
describe at all (pods holding more than the node shows, more instances than its GPUs can
hold, nos's annotations disagreeing with GFD, MPS slices in use) is a :class:`LabelProblem`:
left out of plans with the reason until its agent reports.  So is a node whose GPUs NVIDIA's
device plugin shares (time-slicing; GFD's ``nvidia.com/gpu.replicas`` or a
``mig-<profile>.replicas`` above 1, or a pod holding a ``renameByDefault`` name
``nvidia.com/gpu.shared`` / ``nvidia.com/mig-<profile>.shared``) while pods hold NVIDIA's
devices there (``TimeSlicedBeforeAgent``): each pod holds a replica, not a device, so neither
devices nor GPUs can be counted from the pods, and which one each shares is unknown.  Every
assumption is a sentence in :attr:`Adopted.notes`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from decimal import Decimal
from functools import cache
from typing import Any, Protocol

from contract.nodepartitioning import DesiredGpu, DesiredMigInstance, NodePartitioning
from contract.quantity import ascii_count
from partitioner.node_labels import (
    COUNT_ANNOTATION,
    MIG_CONFIG_LABEL,
    MIG_CONFIG_STATE_LABEL,
    GpuLabels,
    LabelProblem,
)
from partitioner.quantities import QuantityError, parse_quantity, pod_requests
from planner.catalog import Catalog, CatalogError, GpuModel, MigProfile
from planner.geometry import Layout, enumerate_layouts
from planner.snapshot import (
    GpuState,
    MigInstance,
    Mode,
    MpsSlice,
    NodeState,
    is_partitionable_resource,
    mig_profile_of,
)

__all__ = [
    "NOS_STATUS_PREFIX",
    "Adopted",
    "NodeLike",
    "adopt",
    "adopt_all",
    "agent_reported",
    "desired_without_status",
    "gpus_from_status",
    "other_model",
]

NOS_STATUS_PREFIX = "nos.nebuly.com/status-gpu-"
_NOS_STATUS = re.compile(
    r"^nos\.nebuly\.com/status-gpu-(?P<gpu>[0-9]{1,18})-(?P<profile>[^-]+)-(?P<state>free|used)$"
)
_WHOLE_GPU = "nvidia.com/gpu"
_SHARED_SUFFIX = ".shared"
_REPLICAS_LABEL = "nvidia.com/gpu.replicas"
_SHARING_LABEL = "nvidia.com/gpu.sharing-strategy"
_MIG_REPLICAS = re.compile(r"^nvidia\.com/mig-.+\.replicas$")
_SEARCH_STEPS = 20_000
"""Steps of the split search; a node needing more is read as 'split unknown' (locked)."""
_MAX_UNITS = 1 << 20
"""A pod's device request above this is an input error, not a count to loop over."""

Obj = Mapping[str, Any]
Multiset = tuple[tuple[str, int], ...]
"""Profile name -> instances, sorted by name: what one GPU holds."""


@dataclass(frozen=True, slots=True)
class Adopted:
    """A node's GPUs now, with where they came from and what was assumed."""

    gpu_count: int
    gpus: tuple[GpuState, ...]
    source: str
    """``"agent"`` (the NodePartitioning status) or ``"adopted"`` (read from the API)."""
    notes: tuple[str, ...] = ()


def agent_reported(np: NodePartitioning | None) -> bool:
    """The node agent has written its GPUs into the NodePartitioning status."""
    return np is not None and np.status is not None and bool(np.status.gpus)


def gpus_from_status(
    np: NodePartitioning | None, count: int, mode: Mode | None = None
) -> tuple[GpuState, ...]:
    """GPUs ``0..count-1`` as the agent reported them (a GPU it did not list is empty).

    Devices of the other mode (:func:`foreign_mode`, with the node's ``mode``): MIG instances on
    an MPS node, whole-GPU MPS slices on a MIG or hybrid node, left from before the node was
    relabelled.  Free ones are left out (the GPU is planned as empty; a spec entry for it makes
    the agent remove them); with one in use the GPU is locked and kept out of plans and specs
    (:meth:`partitioner.ledger.NodeLedger.gpu_states`, ``_desired_now`` in
    :mod:`partitioner.decide`) until its pod leaves.  Before, an MPS plan took a MIG instance
    for a 0 MiB slice, and building its spec raised in every decision step of the cluster.

    What the agent reports ``unhealthy`` (advertised Unhealthy: an XID error, a GPU NVML cannot
    read) counts as used, so no plan destroys or moves it, and a GPU unhealthy as a whole is
    locked (no plan changes its layout); the ledger keeps such devices from every reservation
    (:func:`partitioner.ledger.unhealthy_free`).  A hybrid host the agent reports ``foreign``
    or unhealthy (or on a GPU unhealthy as a whole) is *sealed*: used itself, its slices used,
    so the plan keeps it exactly and neither adds a slice to it nor offers one of it (before,
    a host was used through its slices only: unpinned, a plan destroyed a foreign host under
    its processes, and the agent refused the spec; pinned by its slices, a plan added new
    slices beside those processes)."""
    actual = {g.index: g for g in (np.status.gpus if np and np.status else ())}
    gpus = []
    for i in range(count):
        g = actual.get(i)
        if g is None:
            gpus.append(GpuState(i))
            continue
        sick = g.unhealthy  # the whole GPU: its layout stays, nothing on it is offered
        gpus.append(
            GpuState(
                i,
                mig=tuple(
                    MigInstance(
                        m.profile,
                        m.start,
                        # A host is used through its slices, unless it is sealed: processes
                        # of no pod run on it, or it (or its GPU) is unhealthy; then the plan
                        # keeps it exactly and adds no slice (:mod:`planner.hybrid`).  An
                        # unhealthy instance is kept.
                        (m.used and not m.mps) or sick or m.unhealthy or bool(m.mps and m.foreign),
                        tuple(
                            MpsSlice(
                                s.memoryMiB,
                                # a sealed host's slices count as used too, so none is offered
                                s.used or sick or m.unhealthy or s.unhealthy or m.foreign,
                                s.activeThreadPercentage,
                            )
                            for s in m.mps
                        ),
                    )
                    for m in g.mig
                ),
                mps=tuple(
                    MpsSlice(s.memoryMiB, s.used or sick or s.unhealthy, s.activeThreadPercentage)
                    for s in g.mps
                ),
                locked=sick,
            )
        )
        if mode is not None and foreign_mode(gpus[-1], mode):
            gpus[-1] = _without_foreign(gpus[-1], mode)
    return tuple(gpus)


def foreign_mode(gpu: GpuState, mode: Mode) -> bool:
    """Does ``gpu`` hold devices of another mode than its node's ``mode`` (MIG instances on an
    MPS node; whole-GPU MPS slices on a MIG or hybrid node; MIG instances hosting MPS slices
    on a MIG node)?"""
    if mode is Mode.MPS:
        return bool(gpu.mig)
    if mode is Mode.MIG:
        return bool(gpu.mps) or any(m.mps for m in gpu.mig)
    return bool(gpu.mps)


def _without_foreign(gpu: GpuState, mode: Mode) -> GpuState:
    """``gpu`` without its free devices of the other mode, or locked as it is with one in use
    (:func:`gpus_from_status`).  A free host on a MIG node is left out whole: planned as free
    space (a spec that keeps it there lists it as a plain instance, and the agent clears its
    slice table), never offered as an instance of its profile while it still hosts slices."""
    if mode is Mode.MPS:
        used = any(m.used or any(s.used for s in m.mps) for m in gpu.mig)
        return replace(gpu, locked=True) if used else replace(gpu, mig=())
    used = any(s.used for s in gpu.mps)
    if mode is Mode.MIG:
        used = used or any(m.mps and (m.used or any(s.used for s in m.mps)) for m in gpu.mig)
        if not used:
            return replace(gpu, mps=(), mig=tuple(m for m in gpu.mig if not m.mps))
    return replace(gpu, locked=True) if used else replace(gpu, mps=())


def desired_without_status(state: NodeState, index: int) -> DesiredGpu | None:
    """The spec entry of GPU ``index`` the plan does not change, on a node whose agent has not
    reported: its adopted layout, or ``None`` when it is locked (left out of the spec, so the
    agent leaves it alone)."""
    gpu = next((g for g in state.gpus if g.index == index), None)
    if gpu is None or gpu.locked:
        return None
    return DesiredGpu(
        index=index,
        mig=[DesiredMigInstance(profile=i.profile, start=i.start) for i in gpu.mig],
    )


# --------------------------------------------------------------------------- readings


def _units(value: Decimal, resource: str, pod: str) -> int | LabelProblem:
    if value != value.to_integral_value() or value < 0 or value > _MAX_UNITS:
        return LabelProblem(
            "UnreadableGpuUse",
            f"pod {pod} requests {resource}: {value}, not a device count (0..{_MAX_UNITS})",
        )
    return int(value)


def _pod_name(pod: Obj) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


@dataclass(slots=True)
class _Use:
    mig: Counter[str]
    """Catalog profile name -> instances held."""
    whole: int = 0
    """Whole GPUs held (``nvidia.com/gpu`` outside the single strategy)."""
    mps: int = 0
    """MPS slices (``nvidia.com/gpu-<N>gb``) held."""
    shared: tuple[str, ...] = ()
    """``.shared`` resource names (NVIDIA's time-slicing with ``renameByDefault``) held."""
    holders: tuple[str, ...] = ()


def _use(pods: Sequence[Obj], model: GpuModel, labels: GpuLabels) -> _Use | LabelProblem:
    use = _Use(Counter())
    holders: list[str] = []
    shared: set[str] = set()
    for pod in pods:
        name = _pod_name(pod)
        try:
            requests = pod_requests(pod)
        except QuantityError as e:  # what it holds cannot be known: leave the node as it is
            return LabelProblem(
                "UnreadableGpuUse", f"running pod {name}: {e}; what it holds cannot be read"
            )
        held = False
        for resource, value in sorted(requests.items()):
            is_shared = _is_shared(resource)
            if resource != _WHOLE_GPU and not is_shared and not is_partitionable_resource(resource):
                continue
            n = _units(value, resource, name)
            if isinstance(n, LabelProblem):
                return n
            if n == 0:
                continue
            held = True
            if is_shared:  # a replica of a time-sliced device: which one is unknown
                shared.add(resource)
                continue
            profile = mig_profile_of(resource)
            if resource == _WHOLE_GPU and labels.single_profile is not None:
                use.mig[labels.single_profile.name] += n
            elif resource == _WHOLE_GPU:
                use.whole += n
            elif profile is None:
                use.mps += n
            else:
                try:
                    use.mig[model.profile(profile).name] += n
                except CatalogError as e:
                    return LabelProblem(
                        "UnreadableGpuUse",
                        f"running pod {name} holds {resource}, which is not a profile of "
                        f"{model.name} ({e})",
                    )
        if held:
            holders.append(name)
    use.holders = tuple(holders)
    use.shared = tuple(sorted(shared))
    return use


def _is_shared(resource: str) -> bool:
    """A name NVIDIA's plugin gives time-sliced devices with ``renameByDefault``
    (``nvidia.com/gpu.shared``, ``nvidia.com/mig-<profile>.shared``)."""
    return resource.endswith(_SHARED_SUFFIX) and (
        resource == _WHOLE_GPU + _SHARED_SUFFIX or mig_profile_of(resource) is not None
    )


def _time_sliced(node: Obj, use: _Use) -> str | None:
    """What shows NVIDIA's plugin time-slices the node's GPUs, or ``None``."""
    labels: Mapping[str, str] = (node.get("metadata") or {}).get("labels") or {}
    strategy = labels.get(_SHARING_LABEL, "")
    how = f", {_SHARING_LABEL}={strategy}" if strategy and strategy != "none" else ""
    for key in sorted(labels):
        if key == _REPLICAS_LABEL or _MIG_REPLICAS.match(key):
            n = ascii_count(str(labels[key]).strip())
            if n is not None and n > 1:
                return f"label {key}={n}{how}"
    if use.shared:
        return f"pods hold {', '.join(use.shared)}"
    return None


def _nos_status(
    annotations: Mapping[str, str], model: GpuModel, count: int
) -> tuple[dict[int, Counter[str]], dict[int, Counter[str]]] | LabelProblem | None:
    """nos's per-GPU instances and used instances, or ``None`` without its annotations."""
    total: dict[int, Counter[str]] = {}
    used: dict[int, Counter[str]] = {}
    for key in sorted(annotations):
        if not key.startswith(NOS_STATUS_PREFIX):
            continue
        m = _NOS_STATUS.match(key)
        n = annotations[key]
        k = ascii_count(n)
        if m is None or k is None:
            return LabelProblem(
                "UnreadableNosStatus",
                f"annotation {key}={n[:40]!r} is not nos's "
                f"'status-gpu-<index>-<profile>-<free|used>: <count>'; remove the stale nos "
                f"annotations (docs/operations.md, 'Migrate from nos')",
            )
        gpu = int(m.group("gpu"))
        if gpu >= count:
            return LabelProblem(
                "UnreadableNosStatus",
                f"annotation {key} names GPU {gpu} but the node has {count} GPU(s); remove the "
                f"stale nos annotations (docs/operations.md, 'Migrate from nos')",
            )
        try:
            profile = model.profile(m.group("profile"))
        except CatalogError as e:
            if re.fullmatch(r"[0-9]+gb", m.group("profile")):
                # nos's MPS status (status-gpu-<index>-<N>gb-<free|used>): the node was nos's
                # MPS node and is now opted in as MIG
                return LabelProblem(
                    "UnreadableNosStatus",
                    f"annotation {key} is nos's status of an MPS slice "
                    f"({m.group('profile')}) on a node now opted in as MIG: nos's annotations "
                    f"from when it partitioned the node for MPS; remove the stale nos "
                    f"annotations (docs/operations.md, 'Migrate from nos')",
                )
            return LabelProblem("UnreadableNosStatus", f"annotation {key}: {e}")
        if k > profile.max_count:
            return LabelProblem(
                "UnreadableNosStatus",
                f"annotation {key}={k}: one {model.name} GPU holds at most {profile.max_count} "
                f"{profile.name}",
            )
        total.setdefault(gpu, Counter())[profile.name] += k
        if m.group("state") == "used":
            used.setdefault(gpu, Counter())[profile.name] += k
    return (total, used) if total else None


def _capacity(node: Obj, model: GpuModel, count: int) -> Counter[str] | LabelProblem:
    capacity = (node.get("status") or {}).get("capacity") or {}
    out: Counter[str] = Counter()
    for resource in sorted(capacity):
        name = mig_profile_of(resource)
        if name is None:
            continue
        try:
            profile = model.profile(name)
            value = parse_quantity(capacity[resource])
        except (CatalogError, QuantityError) as e:
            return LabelProblem("UnreadableGpuUse", f"status.capacity[{resource}]: {e}")
        if value != value.to_integral_value() or not 0 <= value <= count * profile.max_count:
            return LabelProblem(
                "UnreadableGpuUse",
                f"status.capacity[{resource}]={value}: {count} GPU(s) hold 0 to "
                f"{count * profile.max_count} {profile.name} instances",
            )
        out[profile.name] += int(value)
    return +out


# --------------------------------------------------------------------------- geometry


@cache
def _layouts(model: GpuModel, multiset: Multiset) -> tuple[Layout, ...]:
    """Every valid layout holding exactly ``multiset`` (catalog order)."""
    profiles = [model.profile(name) for name, _ in multiset]
    want = Counter(dict(multiset))
    return tuple(
        layout
        for layout in enumerate_layouts(model, (), profiles)
        if Counter(p.profile.name for p in layout) == want
    )


@cache
def _gpu_contents(model: GpuModel, names: tuple[str, ...]) -> tuple[Multiset, ...]:
    """Every multiset of ``names`` one GPU's valid layout can hold, largest first."""
    seen: dict[Multiset, int] = {}
    for layout in enumerate_layouts(model, (), [model.profile(n) for n in names]):
        key = tuple(sorted(Counter(p.profile.name for p in layout).items()))
        seen[key] = sum(p.profile.memory_slices for p in layout)
    return tuple(sorted(seen, key=lambda k: (-seen[k], k)))


def _splits(model: GpuModel, total: Counter[str], gpus: int) -> tuple[list[Multiset], bool, bool]:
    """Split ``total`` over ``gpus`` GPUs: (first split found, unique, search complete).

    GPUs are filled in non-increasing option order (symmetry), so a split is one multiset of
    per-GPU contents; the search stops at a second split or after ``_SEARCH_STEPS`` steps.
    """
    options = [
        o
        for o in _gpu_contents(model, tuple(sorted(total)))
        if all(total[name] >= n for name, n in o)
    ]
    found: list[list[Multiset]] = []
    steps = 0
    chosen: list[Multiset] = []

    def walk(first: int, left: Counter[str]) -> bool:
        nonlocal steps
        steps += 1
        if steps > _SEARCH_STEPS or len(found) > 1:
            return False
        if len(chosen) == gpus:
            if not +left:
                found.append(list(chosen))
            return True
        for k in range(first, len(options)):
            option = options[k]
            if any(left[name] < n for name, n in option):
                continue
            chosen.append(option)
            after = left.copy()
            after.subtract(dict(option))
            ok = walk(k, after)
            chosen.pop()
            if not ok:
                return False
        return True

    complete = walk(0, total.copy())
    first = found[0] if found else []
    return first, complete and len(found) == 1, complete


def _config_contents(config: str, model: GpuModel) -> Multiset | None:
    """Per-GPU contents of the MIG manager's default config ``config`` (``all-<profile>``)."""
    if config in ("all-disabled", "all-enabled"):
        return ()
    if not config.startswith("all-"):
        return None
    try:
        profile: MigProfile = model.profile(config.removeprefix("all-"))
    except CatalogError:
        return None
    return ((profile.name, profile.max_count),)


# --------------------------------------------------------------------------- adoption


def _plural(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def _some(names: Sequence[str], shown: int = 3) -> str:
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


def _describe(counter: Mapping[str, int]) -> str:
    return ", ".join(f"{n} x {p}" for p, n in sorted(counter.items()) if n) or "none"


def _place(
    model: GpuModel,
    index: int,
    contents: Multiset,
    used: Mapping[str, int],
    lock: bool,
) -> GpuState | LabelProblem:
    layouts = _layouts(model, contents)
    if not layouts:
        return LabelProblem(
            "UnreadableMigLayout",
            f"GPU {index} would hold {_describe(dict(contents))}, which no valid {model.name} "
            f"layout holds",
        )
    left = dict(used)
    instances = []
    for p in layouts[0]:
        is_used = left.get(p.profile.name, 0) > 0
        if is_used:
            left[p.profile.name] -= 1
        instances.append(MigInstance(p.profile.name, p.start, is_used))
    return GpuState(index, mig=tuple(instances), locked=lock)


class NodeLike(Protocol):
    """What :func:`adopt_all` needs of a ``partitioner.snapshot.GpuNode``."""

    @property
    def mode(self) -> Mode: ...
    @property
    def gpu_count(self) -> int: ...
    @property
    def labels(self) -> GpuLabels | None: ...


def adopt_all(
    nodes: Mapping[str, Obj],
    gpu_nodes: Mapping[str, NodeLike],
    partitionings: Mapping[str, NodePartitioning],
    pods: Iterable[Obj],
    catalog: Catalog,
) -> dict[str, Adopted | LabelProblem]:
    """:func:`adopt` for every GPU node, with the pods bound to it that have not finished."""
    bound: dict[str, list[Obj]] = {}
    for pod in pods:
        node = str((pod.get("spec") or {}).get("nodeName") or "")
        phase = (pod.get("status") or {}).get("phase")
        if node in gpu_nodes and phase not in ("Succeeded", "Failed"):
            bound.setdefault(node, []).append(pod)
    out: dict[str, Adopted | LabelProblem] = {}
    for name in sorted(gpu_nodes):
        g, np = gpu_nodes[name], partitionings.get(name)
        if g.labels is None:  # built without labels (tests): the report or empty GPUs
            out[name] = Adopted(g.gpu_count, gpus_from_status(np, g.gpu_count, g.mode), "agent")
            continue
        out[name] = adopt(nodes[name], g.mode, g.labels, np, bound.get(name, ()), catalog)
    return out


def adopt(
    node: Obj,
    mode: Mode,
    labels: GpuLabels,
    np: NodePartitioning | None,
    pods: Sequence[Obj],
    catalog: Catalog,
) -> Adopted | LabelProblem:
    """The node's GPUs now (module docstring); ``pods`` are those bound to it, not finished."""
    if agent_reported(np):
        assert np is not None and np.status is not None
        return _reported(node, mode, labels, np, catalog)
    if labels.split_devices:
        names = ", ".join(labels.split_devices)
        return LabelProblem(
            "ComputeInstancesBeforeAgent",
            f"labels {names} count MIG devices of compute instances smaller than their GPU "
            f"instance (nvidia-smi mig -cci, or a mig-parted config with such profiles): how "
            f"many GPU instances hold them, and where, is unknown until the gpuslice agent "
            f"reports (it reads them through NVML); wait for its report. gpuslice serves whole "
            f"GPU instances: the agent does not advertise such an instance, and destroys it "
            f"once no process uses it",
        )
    if labels.gpu_count is None:
        return LabelProblem(
            "GpuCountUnknown",
            f"no label holds the physical GPU count ({labels.count_source}); annotate the node "
            f"gpuslice.io/gpu-count=<GPUs>, or let the gpuslice agent report (it counts GPUs "
            f"through NVML); use the GPU Operator's mig.strategy=mixed to avoid this",
        )
    count = labels.gpu_count
    model = labels.model
    notes: list[str] = [f"GPU count {count} from {labels.count_source}", *labels.notes]
    use = _use(pods, model, labels)
    if isinstance(use, LabelProblem):
        return use
    nvidia_held = bool(use.whole or use.mig or use.shared)  # names NVIDIA's plugin serves
    if nvidia_held and (sliced := _time_sliced(node, use)) is not None:
        by_mps = ((node.get("metadata") or {}).get("labels") or {}).get(_SHARING_LABEL) == "mps"
        config = (
            "its MPS sharing config (sharing.mps)"
            if by_mps
            else "its time-slicing config (sharing.timeSlicing)"
        )
        return LabelProblem(
            "TimeSlicedBeforeAgent",
            f"NVIDIA's device plugin shares this node's GPUs ({sliced}): running pods "
            f"{_some(use.holders)} hold replicas, not devices, and which device or GPU each "
            f"shares is unknown until the gpuslice agent reports (it reads them through NVML "
            f"and the kubelet); wait for its report, or drain them. gpuslice serves whole "
            f"devices: drop {config} from NVIDIA's plugin on gpuslice nodes",
        )
    if mode is Mode.MPS:
        if use.mps or use.whole or use.mig:
            return LabelProblem(
                "GpuInUseBeforeAgent",
                f"running pods {_some(use.holders)} hold GPUs or slices on this MPS node "
                f"before gpuslice's agent has reported, and which GPU they use is unknown; "
                f"drain them (docs/operations.md, 'Migrate from nos') or wait for the agent",
            )
        notes.append("MPS node, no pod holds a GPU: every GPU taken as free")
        return Adopted(count, tuple(GpuState(i) for i in range(count)), "adopted", tuple(notes))
    return _adopt_mig(node, labels, count, use, notes)


def _reported(
    node: Obj, mode: Mode, labels: GpuLabels, np: NodePartitioning, catalog: Catalog
) -> Adopted | LabelProblem:
    """The agent's report as the node's GPUs.  It lists every GPU NVML shows, so its GPU
    count (highest index + 1) wins under every strategy: a count from labels is a guess for
    the time before the report (an admin's annotation, the MIG manager's stale
    ``all-<profile>`` config under ``single``) or counts one model only (GFD's ``gpu.count``
    on a node with a second GPU model); one that disagrees is named in a note with its fix,
    never obeyed (it dropped reported GPUs from every plan, or planned GPUs that do not
    exist).  A reported GPU of another model than the labels', or of one the catalog does not
    know, is a problem (:func:`other_model`): one model per node."""
    assert np.status is not None
    other = other_model(np, labels.model, catalog)
    if other is not None:
        return LabelProblem("MixedGpuModels", other)
    reported = max(g.index for g in np.status.gpus) + 1
    if reported > catalog.max_gpus_per_node:
        return LabelProblem(
            "TooManyGpus",
            f"the NodePartitioning status lists GPU index {reported - 1}: more than any "
            f"server holds (max_gpus_per_node {catalog.max_gpus_per_node})",
        )
    notes: list[str] = []
    if labels.gpu_count is not None and labels.gpu_count != reported:
        notes.append(_count_mismatch(node, labels, reported))
    said = (
        f"GPU count {reported} from the agent's NodePartitioning status (NVML)",
        "instances and their use: the agent's report",
        *notes,
    )
    return Adopted(reported, gpus_from_status(np, reported, mode), "agent", said)


def other_model(np: NodePartitioning | None, model: GpuModel, catalog: Catalog) -> str | None:
    """Why the node cannot be planned when its agent reports a GPU of another catalog model
    than its labels name, or of a model the catalog does not know (GPU Feature Discovery
    labels one model per node, whichever it read last, and counts only that one): every GPU
    would be planned as the labelled model -- MIG profiles or MPS memory the other GPU does
    not have, refused by the agent again after every plan -- and, with GFD's count, a GPU of
    the labelled model left out of every plan.  ``None`` if every GPU the agent names is of
    the labelled model."""
    for g in np.status.gpus if np is not None and np.status is not None else ():
        if not g.model:
            continue
        try:
            found = catalog.model(g.model).name
        except CatalogError:
            found = ""
        if found == model.name:
            continue
        what = found or f"{g.model!r}, a model the GPU catalog does not know"
        node = (np.metadata.name if np is not None else "") or "<node>"
        return (
            f"the agent reports GPU {g.index} as {what} but the node's labels say "
            f"{model.name}: gpuslice plans one GPU model per node; keep GPUs of one model "
            "per node (a display GPU beside data-centre GPUs too), or opt the node out "
            f"(remove its label: kubectl label node {node} gpuslice.io/partitioning-)"
        )
    return None


def _count_mismatch(node: Obj, labels: GpuLabels, reported: int) -> str:
    """The note naming a label count that disagrees with the agent's, and what fixes it."""
    name = (node.get("metadata") or {}).get("name") or "<node>"
    source = labels.count_source
    if source.startswith(f"annotation {COUNT_ANNOTATION}"):
        fix = (
            f"remove the annotation, the agent counts GPUs now: kubectl annotate node {name} "
            f"{COUNT_ANNOTATION}-"
        )
    elif source.startswith(MIG_CONFIG_LABEL):
        fix = (
            f"{MIG_CONFIG_LABEL} is stale (the MIG manager is off on gpuslice nodes): remove "
            f"it, kubectl label node {name} {MIG_CONFIG_LABEL}- {MIG_CONFIG_STATE_LABEL}-"
        )
    else:
        fix = "GPU Feature Discovery relabels the node on its next pass"
    return (
        f"the labels give {labels.gpu_count} GPU(s) ({source}) but the agent reports "
        f"{reported} through NVML: the agent's count is used; {fix}"
    )


def _adopt_mig(
    node: Obj, labels: GpuLabels, count: int, use: _Use, notes: list[str]
) -> Adopted | LabelProblem:
    model = labels.model
    annotations: Mapping[str, str] = (node.get("metadata") or {}).get("annotations") or {}
    nos = _nos_status(annotations, model, count)
    if isinstance(nos, LabelProblem):
        return nos
    per_gpu: dict[int, Counter[str]] | None = None
    nos_used: dict[int, Counter[str]] = {}
    if nos is not None:
        per_gpu, nos_used = nos
        total: Counter[str] = sum(per_gpu.values(), Counter())
        source = "nos's status annotations (per GPU)"
        if labels.mig_devices is not None and +Counter(labels.mig_devices) != +total:
            return LabelProblem(
                "UnreadableMigLayout",
                f"nos's status annotations show {_describe(total)} but GPU Feature Discovery's "
                f"labels show {_describe(labels.mig_devices)}: the annotations are stale; remove "
                f"them (docs/operations.md, 'Migrate from nos')",
            )
    elif labels.mig_devices is not None:
        total = +Counter(labels.mig_devices)
        source = f"GPU Feature Discovery's labels (mig.strategy={labels.strategy.value})"
    else:
        capacity = _capacity(node, model, count)
        if isinstance(capacity, LabelProblem):
            return capacity
        total = capacity
        source = "the node's status.capacity (nvidia.com/mig-*)"
    if total or nos is not None or labels.mig_devices is not None:
        notes.append(f"MIG instances from {source}: {_describe(total)}")
    else:
        notes.append(
            "no reading shows MIG instances (no mixed/single GFD labels, nos annotations or "
            "nvidia.com/mig-* capacity): assumed none"
        )
    over = {p: n for p, n in use.mig.items() if n > total[p]}
    if over:
        return LabelProblem(
            "UnreadableMigLayout",
            f"running pods {_some(use.holders)} hold {_describe(use.mig)} but the node shows "
            f"{_describe(total)} ({source}); wait for the gpuslice agent's report",
        )
    if use.mig or use.whole:
        notes.append(
            f"in use by {_plural(len(use.holders), 'running pod')} ({_some(use.holders)}): "
            f"{_describe(use.mig)}" + (f", {_plural(use.whole, 'whole GPU')}" if use.whole else "")
        )
    any_used = bool(use.mig or use.whole)

    if per_gpu is not None:
        gpus_used = {i: c for i, c in nos_used.items()}
        nos_sum: Counter[str] = sum(nos_used.values(), Counter())
        # nos's per-GPU "used" annotations are as old as nos's last report: once nos is gone a
        # pod may end on one GPU and another start on a second, the totals unchanged, so which
        # GPU holds what is never taken from them -- while pods use MIG instances every GPU
        # with instances is locked, as from GPU Feature Discovery's labels (trusting matching
        # totals, a plan reshaped a GPU under a running pod)
        gpus_used_known = False
        if +nos_sum != +use.mig:
            notes.append(
                f"nos says {_describe(nos_sum)} in use, the pods hold {_describe(use.mig)}: which "
                f"GPU holds them is unknown"
            )
        contents = {i: tuple(sorted((+per_gpu.get(i, Counter())).items())) for i in range(count)}
        index_known = True
    else:
        spread, index_known, gpus_used, gpus_used_known = _spread(
            model, labels, total, count, use, notes
        )
        if isinstance(spread, LabelProblem):
            return spread
        contents = spread
    held_whole = use.whole
    if held_whole and held_whole + sum(1 for c in contents.values() if c) > count:
        return LabelProblem(
            "UnreadableMigLayout",
            f"pods hold {_plural(held_whole, 'whole GPU')} beside instances on "
            f"{sum(1 for c in contents.values() if c)} GPU(s), more than the node's {count}",
        )
    gpus: list[GpuState] = []
    locked: list[int] = []
    left = use.mig.copy()
    for i in range(count):
        mine = dict(contents[i])
        if gpus_used_known:
            used_here: dict[str, int] = dict(gpus_used.get(i, Counter()))
        else:
            used_here = {p: min(n, left[p]) for p, n in mine.items()}
        for p, n in used_here.items():
            left[p] -= n
        exact = (
            index_known
            and gpus_used_known
            and all(used_here.get(p, 0) in (0, n) for p, n in mine.items())
            and len(_layouts(model, contents[i])) <= 1
        )
        if gpus_used_known:
            may_hold = any(used_here.values())
        elif index_known:  # the same contents known on this index, its users not
            may_hold = bool(mine) and any_used
        else:  # which GPU holds what is unknown: even one read as empty may be the one
            may_hold = any_used
        lock = any_used and (held_whole > 0 or (may_hold and not exact))
        gpu = _place(model, i, contents[i], used_here, lock)
        if isinstance(gpu, LabelProblem):
            return gpu
        gpus.append(gpu)
        if lock:
            locked.append(i)
    if locked:
        notes.append(
            f"locked GPU {', '.join(map(str, locked))}: may hold instances in use whose GPU, "
            f"place or user is not known exactly; plans keep it as it is (free instances still "
            f"take pods) until the gpuslice agent reports"
        )
    elif total and not any_used:
        notes.append("no instance is in use: every GPU may be reshaped")
    return Adopted(count, tuple(gpus), "adopted", tuple(notes))


def _spread(
    model: GpuModel,
    labels: GpuLabels,
    total: Counter[str],
    count: int,
    use: _Use,
    notes: list[str],
) -> tuple[dict[int, Multiset] | LabelProblem, bool, dict[int, Counter[str]], bool]:
    """Node-level counts -> per-GPU contents; (contents, index known, used per GPU, used known)."""
    empty: dict[int, Counter[str]] = {}
    if not total:
        return {i: () for i in range(count)}, True, empty, True
    config = _config_contents(labels.mig_config, model)
    if config is not None and +Counter({p: n * count for p, n in config}) == total:
        notes.append(
            f"the MIG manager's applied config {labels.mig_config} puts {_describe(dict(config))} "
            f"on every GPU"
        )
        split, identical = [config] * count, True
    else:
        split, unique, complete = _splits(model, total, count)
        if not split:
            what = "hold" if complete else "could be read as holding (search budget spent)"
            return (
                LabelProblem(
                    "UnreadableMigLayout",
                    f"{count} {model.name} GPU(s) cannot {what} {_describe(total)}; wait for the "
                    f"gpuslice agent's report",
                ),
                False,
                empty,
                False,
            )
        identical = unique and len(set(split)) == 1
        if unique and not identical:
            notes.append(
                f"the only split over the GPUs is {' | '.join(_describe(dict(c)) for c in split)}, "
                f"but which GPU holds which is unknown"
            )
        elif not unique:
            notes.append(
                f"{_describe(total)} can be spread over the GPUs in several ways; assumed "
                f"{' | '.join(_describe(dict(c)) for c in split)}"
            )
    contents = {i: split[i] for i in range(count)}
    if count == 1:
        return contents, True, {0: use.mig.copy()}, True
    if identical:
        known = all(n in (0, total[p]) for p, n in use.mig.items())
        per = {i: Counter({p: n // count for p, n in use.mig.items()}) for i in range(count)}
        return contents, True, per, known
    return contents, False, empty, False
