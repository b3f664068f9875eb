"""The planner's input and output types: a cluster snapshot in, a plan out. Pure data.

Input (:class:`Snapshot`)
-------------------------
* :class:`NodeState` — a node that takes part in planning: name, mode (``mig``/``mps``/
  ``hybrid``), catalog GPU model name, CPU (milli) and memory (MiB) still allocatable, and its
  GPUs.  Each :class:`GpuState` lists the MIG instances (:class:`MigInstance`: profile name,
  start slot, used or free; on ``hybrid`` nodes also the MPS slices inside it) or MPS slices
  (:class:`MpsSlice`: memory MiB, used or free) it has now.  ``gpu_memory_mib`` overrides the catalog memory (the ``nvidia.com/gpu.memory`` label).
* :class:`PendingPod` — a pod waiting for slices: per extended resource a count
  (``nvidia.com/mig-1g.10gb: 2``, ``nvidia.com/gpu-10gb: 1``), CPU and memory requests,
  priority, and the nodes it may go to (after nodeSelector, affinity, taints; ``None`` = any).

Output (:class:`Plan`)
----------------------
* ``layouts``: for every GPU whose layout changes, the *full* desired layout — every MIG
  instance with its start, or every MPS slice with its memory and active-thread percentage;
  on ``hybrid`` nodes also the MPS slices inside each instance that hosts some
  (:attr:`PlannedGpu.mig_mps`).  GPUs not listed keep their current layout.
* ``assignments``: the expected pod -> (node, per-resource GPU indices) placement; for an MPS
  slice inside a MIG instance (hybrid) also the start of the hosting instance.
* ``unplaced``: a reason for every pending pod the plan cannot place.

Resource names: ``nvidia.com/mig-<profile>`` (MIG), ``nvidia.com/gpu-<N>gb`` (an MPS slice of
``N`` GiB = ``N * 1024`` MiB of GPU memory).  kube-scheduler and the kubelet match extended
resource names exactly, case included, and the node agent advertises *canonical* names only:
the catalog's profile name with ``+`` spelled ``.`` (``nvidia.com/mig-1g.10gb.me``), and ``N``
in decimal without leading zeros (``nvidia.com/gpu-10gb``).  Every name the webhook gates --
``nvidia.com/mig-`` followed by anything, ``nvidia.com/gpu-<ASCII digits>gb`` -- is a *slice
name* (:func:`is_partitionable_resource`), so a gated pod is always one the partitioner judges;
a slice name that is not canonical (``nvidia.com/gpu-010gb``, ``nvidia.com/mig-1G.10GB``) is one
no node ever advertises, and the partitioner rejects the pod asking for it, naming the canonical
spelling (:func:`canonical_mps_resource`, :meth:`planner.catalog.GpuModel.requested_profile`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = [
    "MIG_RESOURCE_PREFIX",
    "MPS_RESOURCE",
    "Assignment",
    "GpuState",
    "MigInstance",
    "Mode",
    "MpsSlice",
    "NodeState",
    "PendingPod",
    "Plan",
    "PlannedGpu",
    "PlannedSlice",
    "Snapshot",
    "Unplaced",
    "canonical_mps_resource",
    "is_partitionable_resource",
    "mig_profile_of",
    "mig_resource",
    "mps_gb_of",
    "mps_near_miss",
    "mps_resource",
]

MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
MPS_RESOURCE = re.compile(r"^nvidia\.com/gpu-(?P<gb>0|[1-9][0-9]*)gb\Z")
"""A canonical MPS resource name: ``N`` in ASCII decimal without leading zeros (``gpu-0gb``
parses, to be refused as smaller than 1 GB; ``gpu-010gb`` does not: no node advertises it)."""
_MPS_NAME = re.compile(r"nvidia\.com/gpu-(?P<gb>[0-9]+)gb")
"""Any MPS slice name the webhook gates, canonical or not (matched whole, ASCII digits, like
:data:`partitioner.gating.MATCH_CONDITIONS`)."""


def mig_profile_of(resource: str) -> str | None:
    """``nvidia.com/mig-1g.10gb`` -> ``1g.10gb``; ``None`` for other resources."""
    if resource.startswith(MIG_RESOURCE_PREFIX):
        return resource[len(MIG_RESOURCE_PREFIX) :]
    return None


def mig_resource(profile: str) -> str:
    """``1g.10gb`` -> ``nvidia.com/mig-1g.10gb``; ``1g.10gb+me`` -> ``nvidia.com/mig-1g.10gb.me``.

    Kubernetes resource names cannot hold ``+``; NVIDIA's device plugin spells a profile's
    ``+`` as ``.``, and so does every resource name gpuslice plans or advertises.
    """
    return MIG_RESOURCE_PREFIX + profile.replace("+", ".")


def mps_gb_of(resource: str) -> int | None:
    """``nvidia.com/gpu-10gb`` -> ``10``; ``None`` for other resources, and for a
    non-canonical spelling (``nvidia.com/gpu-010gb``: no node advertises it, see
    :func:`canonical_mps_resource`)."""
    m = MPS_RESOURCE.match(resource)
    return int(m.group("gb")) if m else None


def canonical_mps_resource(resource: str) -> str | None:
    """The canonical spelling of an MPS slice name: ``nvidia.com/gpu-010gb`` ->
    ``nvidia.com/gpu-10gb`` (itself when canonical); ``None`` for other resources."""
    m = _MPS_NAME.fullmatch(resource)
    return mps_resource(int(m.group("gb"))) if m else None


def mps_near_miss(resource: str) -> str | None:
    """The canonical MPS name a non-canonical spelling means (``nvidia.com/gpu-010gb`` ->
    ``nvidia.com/gpu-10gb``); ``None`` for a canonical name, a name that is no MPS slice name,
    or a size of zero (``gpu-00gb``: refused as smaller than 1 GB, not as a misspelling)."""
    canonical = canonical_mps_resource(resource)
    if canonical is None or canonical == resource or mps_gb_of(canonical) == 0:
        return None
    return canonical


def mps_resource(gb: int) -> str:
    return f"nvidia.com/gpu-{gb}gb"


def is_partitionable_resource(resource: str) -> bool:
    """A slice name: one the webhook gates (module docstring), canonical or not."""
    return mig_profile_of(resource) is not None or _MPS_NAME.fullmatch(resource) is not None


class Mode(StrEnum):
    MIG = "mig"
    MPS = "mps"
    HYBRID = "hybrid"
    """MIG instances, some of which host MPS slices (:mod:`planner.hybrid`): pods asking for
    ``nvidia.com/mig-<profile>`` get whole instances, pods asking for ``nvidia.com/gpu-<N>gb``
    get an MPS slice inside an instance."""


@dataclass(frozen=True, slots=True)
class MpsSlice:
    memory_mib: int
    used: bool = False
    thread_percentage: int | None = None


@dataclass(frozen=True, slots=True)
class MigInstance:
    profile: str
    start: int
    used: bool = False
    """A pod holds the whole instance (or processes run on it).  On a hybrid host (``mps``
    not empty) it *seals* the host: processes of no pod run on it, or it is unhealthy; the
    plan keeps it and its slices exactly and offers none of its free slices
    (:mod:`planner.hybrid`)."""
    mps: tuple[MpsSlice, ...] = ()
    """Hybrid nodes: the MPS slices this instance hosts (its daemon serves them).  An instance
    holding a used slice is pinned like a used instance (:attr:`pinned`)."""

    @property
    def pinned(self) -> bool:
        """Used itself, or hosting a used MPS slice: the plan keeps it where it is."""
        return self.used or any(s.used for s in self.mps)


@dataclass(frozen=True, slots=True)
class GpuState:
    index: int
    mig: tuple[MigInstance, ...] = ()
    mps: tuple[MpsSlice, ...] = ()
    locked: bool = False
    """Keep this MIG GPU's layout exactly as it is: where its instances sit or which of them
    pods hold is not known exactly (instances that existed before gpuslice, read from node
    labels).  Its free instances may still take pods; nothing on it is created or destroyed."""


@dataclass(frozen=True, slots=True)
class NodeState:
    name: str
    mode: Mode
    model: str
    gpus: tuple[GpuState, ...]
    cpu_milli_free: int = 1 << 40
    memory_mib_free: int = 1 << 50
    gpu_memory_mib: int | None = None


@dataclass(frozen=True, slots=True)
class PendingPod:
    name: str
    """Unique key, e.g. ``namespace/name``."""
    requests: Mapping[str, int]
    """Partitionable resource -> count."""
    cpu_milli: int = 0
    memory_mib: int = 0
    priority: int = 0
    eligible_nodes: frozenset[str] | None = None
    """Nodes the pod may run on; ``None`` means any node of the snapshot."""
    waited_s: float = 0.0
    """How long the pod has been waiting for a slice (seconds); feeds the waiting-time level
    of the objective (:attr:`planner.settings.PlannerSettings.wait_tiers_s`)."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    nodes: tuple[NodeState, ...]
    pods: tuple[PendingPod, ...]


@dataclass(frozen=True, slots=True)
class PlannedSlice:
    """An MPS slice in a desired layout."""

    memory_mib: int
    thread_percentage: int
    used: bool = False


@dataclass(frozen=True, slots=True)
class PlannedGpu:
    """The full desired layout of one GPU (exactly one of ``mig``/``mps`` is meaningful)."""

    node: str
    index: int
    mig: tuple[tuple[str, int], ...] = ()
    """(profile name, start) for every instance, sorted by start."""
    mps: tuple[PlannedSlice, ...] = ()
    mig_mps: tuple[tuple[int, tuple[PlannedSlice, ...]], ...] = ()
    """Hybrid: (instance start, its MPS slices) for every instance of ``mig`` that hosts
    slices, sorted by start; an instance not listed hosts none (a whole MIG device)."""


@dataclass(frozen=True, slots=True)
class Assignment:
    node: str
    gpus: Mapping[str, tuple[int, ...]]
    """Resource -> the GPU index of each unit requested."""
    hosts: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Hybrid MPS resources only: resource -> the start of the MIG instance hosting each unit's
    slice (parallel to ``gpus``)."""


class Unplaced(StrEnum):
    """Machine-readable reason codes; the plan's ``unplaced`` map adds the human text."""

    NO_ELIGIBLE_NODE = "no eligible node"
    EXCEEDS_GPU = "exceeds any GPU"
    UNKNOWN_RESOURCE = "unknown resource"
    CAPACITY = "capacity"
    NODE_RESOURCES = "node cpu/memory"
    MPS_SLICES = "more than one MPS slice"


@dataclass(frozen=True, slots=True)
class Plan:
    layouts: Mapping[tuple[str, int], PlannedGpu]
    assignments: Mapping[str, Assignment]
    unplaced: Mapping[str, str]
    """Pod -> human-readable reason starting with an :class:`Unplaced` code."""
    policy: str = "cpsat"
    status: str = ""
    """Solver status (``OPTIMAL``, ``FEASIBLE``, ``GREEDY_FALLBACK`` ...)."""
    stats: Mapping[str, float] = field(default_factory=dict)
