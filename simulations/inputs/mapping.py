"""Mapping of fractional GPU requests (openb ``gpu_milli``) to partitionable slices.

The traces ask for *shares* of a GPU; a MIG or MPS cluster serves *slices*.  A mapping turns a
:class:`~simulations.inputs.workload.Pod` into the extended resources it would request on a GPU model of
:mod:`planner.catalog` (:class:`SliceRequest`; CPU-only pods map to ``None``).

Rules (selectable by name with :func:`make_mapping`)
-----------------------------------------------------
``mig-compute``
    The smallest MIG profile whose compute slices are ``>= gpu_milli × C / 1000`` (``C`` = the
    model's compute slices, 7 on A100/H100), fewest memory slices among equals.
``mig-memory``
    The smallest MIG profile whose share of the memory slots (``memory_slices / memory_slots``)
    is ``>= gpu_milli / 1000``, fewest compute slices among equals.
``mps-memory[:G]``
    An MPS slice of ``max(G, floor(gpu_milli / 1000 × U / G) × G)`` GiB, where ``U`` is the GiB
    an MPS GPU offers to slices: its memory minus the MPS server reserve (512 MiB by default,
    as the planner keeps), rounded down (granularity ``G`` GiB, default 1); resource
    ``nvidia.com/gpu-<N>gb``.  Rounding *down* keeps the property that matters: shares that fit
    one GPU together (``sum gpu_milli <= 1000``) map to slices that fit one GPU together (two
    500-milli pods on an A100-80GB get 39 GiB each, not 40 + 40 > 79.5 usable, nos issue #47).
``hybrid``
    Latency-sensitive pods (qos ``LS`` or ``Guaranteed``) by ``mig-compute``, the rest
    (``BE``, ``Burstable``, unknown) by ``mps-memory``.
``hybrid-threshold:T[:G]``
    By size instead of QoS: a pod whose share is at least ``T`` milli (``1 <= T <= 1000``),
    and every whole-GPU or multi-GPU pod, by ``mig-compute`` (a whole MIG instance); a
    smaller share by ``mps-memory[:G]`` (an MPS slice, which on a hybrid node lives inside a
    MIG instance).  The user's request is the same either way; the threshold only says which
    shares deserve hardware isolation.

Whole-GPU requests (``gpu_milli = 1000``) and multi-GPU pods map to ``num_gpu`` full slices: the
model's largest MIG profile, or an MPS slice of all the memory the GPU offers to slices.  Media-extension and other
profile variants (``+me``) are never chosen: they are the same size as their base profile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from planner.catalog import GpuModel, MigProfile, default_catalog
from planner.settings import PlannerSettings
from planner.snapshot import mps_resource
from simulations.inputs.workload import GPU_MILLI, Pod

MPS_RESERVE_MIB = PlannerSettings().mps_reserve_mib
"""The planner's default MPS server reserve per GPU, MiB."""

__all__ = [
    "MAPPINGS",
    "Hybrid",
    "HybridThreshold",
    "Mapping",
    "MappingError",
    "MigByCompute",
    "MigByMemory",
    "MpsByMemory",
    "SliceRequest",
    "make_mapping",
]

MAPPINGS = ("mig-compute", "mig-memory", "mps-memory", "hybrid", "hybrid-threshold")
MIG_QOS = frozenset({"LS", "Guaranteed"})
"""QoS classes the hybrid rule sends to MIG (isolation for latency-sensitive pods)."""


class MappingError(ValueError):
    """A mapping cannot be built or cannot serve a pod (message names both and the fix)."""


@dataclass(frozen=True, slots=True)
class SliceRequest:
    """What one pod asks for: ``count`` units of one extended ``resource``."""

    kind: Literal["mig", "mps"]
    resource: str
    count: int
    profile: str | None = None
    """MIG profile name (``mig`` kind)."""
    memory_gb: int | None = None
    """MPS slice size in GiB (``mps`` kind)."""

    def as_requests(self) -> dict[str, int]:
        """The ``requests`` mapping of a :class:`planner.snapshot.PendingPod`."""
        return {self.resource: self.count}


class Mapping(Protocol):
    name: str

    def map(self, pod: Pod) -> SliceRequest | None: ...


def _model(model: str | GpuModel) -> GpuModel:
    return default_catalog().model(model) if isinstance(model, str) else model


def _base_profiles(model: GpuModel) -> list[MigProfile]:
    profiles = [p for p in model.profiles if not p.variant]
    if not profiles:
        raise MappingError(
            f"GPU model {model.name} is not MIG-capable; use the mps-memory mapping for it"
        )
    return profiles


def _mig(profile: MigProfile, count: int) -> SliceRequest:
    return SliceRequest("mig", profile.resource, count, profile=profile.name)


class MigByCompute:
    """Smallest profile with compute slices >= gpu_milli × C / 1000."""

    name = "mig-compute"

    def __init__(self, model: str | GpuModel) -> None:
        self.model = _model(model)
        self._profiles = sorted(
            _base_profiles(self.model), key=lambda p: (p.compute, p.memory_slices)
        )

    def map(self, pod: Pod) -> SliceRequest | None:
        if pod.is_cpu_only:
            return None
        need = pod.gpu_milli * self.model.compute_slices / GPU_MILLI
        for p in self._profiles:
            if p.compute >= need:
                return _mig(p, pod.num_gpu)
        raise MappingError(
            f"pod {pod.name}: no MIG profile of {self.model.name} has {need} compute slices"
        )


class MigByMemory:
    """Smallest profile whose share of the memory slots is >= gpu_milli / 1000."""

    name = "mig-memory"

    def __init__(self, model: str | GpuModel) -> None:
        self.model = _model(model)
        self._profiles = sorted(
            _base_profiles(self.model), key=lambda p: (p.memory_slices, p.compute)
        )

    def map(self, pod: Pod) -> SliceRequest | None:
        if pod.is_cpu_only:
            return None
        for p in self._profiles:
            # memory_slices / memory_slots >= gpu_milli / 1000, in integers
            if p.memory_slices * GPU_MILLI >= pod.gpu_milli * self.model.memory_slots:
                return _mig(p, pod.num_gpu)
        raise MappingError(f"pod {pod.name}: no MIG profile of {self.model.name} is large enough")


class MpsByMemory:
    """An MPS slice of the pod's share of GPU memory, rounded up to ``granularity_gb``."""

    name = "mps-memory"

    def __init__(
        self,
        model: str | GpuModel,
        granularity_gb: int = 1,
        reserve_mib: int = MPS_RESERVE_MIB,
    ) -> None:
        if granularity_gb < 1:
            raise MappingError(f"MPS granularity must be >= 1 GiB, got {granularity_gb}")
        self.model = _model(model)
        self.granularity_gb = granularity_gb
        self.gpu_gb = max(0, self.model.memory_mib - reserve_mib) // 1024
        """GiB the GPU offers to MPS slices (memory minus the server reserve)."""
        self.max_gb = self.gpu_gb // granularity_gb * granularity_gb
        if self.max_gb < granularity_gb:
            raise MappingError(
                f"MPS granularity {granularity_gb} GiB exceeds the {self.gpu_gb} GiB "
                f"{self.model.name} offers to MPS slices; use a smaller granularity"
            )

    def map(self, pod: Pod) -> SliceRequest | None:
        if pod.is_cpu_only:
            return None
        g = self.granularity_gb
        gb = max(g, pod.gpu_milli * self.gpu_gb // GPU_MILLI // g * g)
        if pod.gpu_milli == GPU_MILLI:
            gb = self.max_gb
        return SliceRequest("mps", mps_resource(gb), pod.num_gpu, memory_gb=gb)


class Hybrid:
    """Latency-sensitive pods on MIG (``mig``), the others on MPS (``mps``)."""

    name = "hybrid"

    def __init__(self, mig: Mapping, mps: Mapping, mig_qos: frozenset[str] = MIG_QOS) -> None:
        self.mig, self.mps, self.mig_qos = mig, mps, mig_qos

    def map(self, pod: Pod) -> SliceRequest | None:
        return (self.mig if pod.qos in self.mig_qos else self.mps).map(pod)


class HybridThreshold:
    """Shares ``>= threshold`` milli (and whole GPUs) on MIG (``mig``), smaller ones on MPS."""

    name = "hybrid-threshold"

    def __init__(self, mig: Mapping, mps: Mapping, threshold: int) -> None:
        if not 1 <= threshold <= GPU_MILLI:
            raise MappingError(
                f"hybrid-threshold: the threshold must be 1..{GPU_MILLI} milli, got {threshold}"
            )
        self.mig, self.mps, self.threshold = mig, mps, threshold

    def map(self, pod: Pod) -> SliceRequest | None:
        if pod.is_cpu_only:
            return None
        big = not pod.is_sharing or pod.gpu_milli >= self.threshold
        return (self.mig if big else self.mps).map(pod)


def make_mapping(
    spec: str, model: str | GpuModel, mps_reserve_mib: int = MPS_RESERVE_MIB
) -> Mapping:
    """``mig-compute``, ``mig-memory``, ``mps-memory[:G]``, ``hybrid[:G]`` or
    ``hybrid-threshold:T[:G]`` for ``model``."""
    name, _, arg = spec.partition(":")
    if name == "hybrid-threshold":
        t_txt, _, g_txt = arg.partition(":")
        try:
            threshold = int(t_txt)
            gran = int(g_txt) if g_txt else 1
        except ValueError:
            raise MappingError(
                f"mapping {spec!r}: use hybrid-threshold:T[:G] with T in milli (1..1000) and "
                f"G in GiB, e.g. hybrid-threshold:500"
            ) from None
        return HybridThreshold(
            MigByCompute(model), MpsByMemory(model, gran, mps_reserve_mib), threshold
        )
    granularity = 1
    if arg:
        try:
            granularity = int(arg)
        except ValueError:
            raise MappingError(
                f"mapping {spec!r}: granularity {arg!r} is not an integer (GiB)"
            ) from None
    if name == "mig-compute":
        return MigByCompute(model)
    if name == "mig-memory":
        return MigByMemory(model)
    if name == "mps-memory":
        return MpsByMemory(model, granularity, mps_reserve_mib)
    if name == "hybrid":
        return Hybrid(MigByCompute(model), MpsByMemory(model, granularity, mps_reserve_mib))
    raise MappingError(f"unknown mapping {spec!r}; choose one of {', '.join(MAPPINGS)}")
