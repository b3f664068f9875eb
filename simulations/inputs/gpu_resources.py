"""NVIDIA GPU resource names as pods request them, and as kube-state-metrics spells them.

Model
-----
A pod asks the scheduler for GPUs with an extended resource of the ``nvidia.com/`` domain.
The simulator knows three kinds (:func:`classify`):

* ``nvidia.com/gpu`` -- whole GPUs (:data:`WHOLE`);
* ``nvidia.com/mig-<profile>`` -- MIG instances of one profile, as NVIDIA's device plugin
  (``mig.strategy=mixed``) and gpuslice's agent advertise them (``1g.10gb``, ``1g.10gb.me``)
  (:data:`MIG`);
* ``nvidia.com/gpu-<N>gb`` -- an MPS slice of ``N`` GiB, as gpuslice (and nos) advertise it
  (:data:`MPS`).

Any other ``nvidia.com/`` name (``nvidia.com/gpu.shared`` from time-slicing, a typo) is a GPU
request the simulator cannot replay; readers refuse it, naming the pod and the
``--map-resource FROM=TO`` that renames it (:func:`parse_resource_map`).  Resources of other
domains are not GPU requests and are ignored.

kube-state-metrics puts the resource name into the ``resource`` label after replacing every
character outside ``[a-zA-Z0-9_]`` with ``_`` (``sanitizeLabelName`` in its
``internal/store/utils.go``): ``nvidia.com/mig-1g.10gb`` becomes ``nvidia_com_mig_1g_10gb``.
:func:`from_ksm_label` maps the three kinds back; it is exact for them because profile names
hold only digits, letters and dots (``+`` is already spelled ``.`` in resource names).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from planner.snapshot import MIG_RESOURCE_PREFIX, MPS_RESOURCE, mps_resource

__all__ = [
    "ACCEPTED",
    "MIG",
    "MPS",
    "NVIDIA_DOMAIN",
    "WHOLE",
    "WHOLE_GPU",
    "ResourceMapError",
    "apply_resource_map",
    "classify",
    "from_ksm_label",
    "is_gpu_resource",
    "ksm_label_of",
    "parse_resource_map",
]

NVIDIA_DOMAIN = "nvidia.com/"
WHOLE_GPU = "nvidia.com/gpu"
WHOLE = "whole"
MIG = "mig"
MPS = "mps"
ACCEPTED = (
    "nvidia.com/mig-<profile> (MIG, e.g. nvidia.com/mig-1g.10gb), nvidia.com/gpu-<N>gb "
    "(an MPS slice of N GiB, e.g. nvidia.com/gpu-10gb) or nvidia.com/gpu (whole GPUs)"
)
"""The GPU resource names the simulator replays, in words (for error messages)."""

_MIG_PROFILE = re.compile(r"^(\d+c\.)?\d+g\.\d+gb(\.[a-z]+)*$")
"""A MIG profile in its resource spelling (``1g.10gb``, ``1g.10gb.me``, ``1c.3g.40gb``)."""
_KSM_MIG = re.compile(r"^nvidia_com_mig_(?P<rest>[a-z0-9_]+)$")
_KSM_MPS = re.compile(r"^nvidia_com_gpu_(?P<gb>\d+)gb$")
_KSM_INVALID = re.compile(r"[^a-zA-Z0-9_]")


class ResourceMapError(ValueError):
    """A ``--map-resource`` entry is malformed (the message names it and the expected form)."""


def classify(resource: str) -> str | None:
    """:data:`WHOLE`, :data:`MIG` or :data:`MPS` for a replayable name, ``None`` otherwise."""
    if resource == WHOLE_GPU:
        return WHOLE
    if resource.startswith(MIG_RESOURCE_PREFIX):
        profile = resource[len(MIG_RESOURCE_PREFIX) :]
        return MIG if _MIG_PROFILE.match(profile) else None
    m = MPS_RESOURCE.match(resource)
    if m and int(m.group("gb")) >= 1:
        return MPS
    return None


def is_gpu_resource(resource: str) -> bool:
    """A name of the ``nvidia.com/`` domain (replayable or not), also as kube-state-metrics
    spells it (``nvidia_com_...``)."""
    return resource.startswith((NVIDIA_DOMAIN, "nvidia_com_"))


def from_ksm_label(label: str) -> str:
    """kube-state-metrics' ``resource`` label -> the Kubernetes resource name.

    ``nvidia_com_gpu`` -> ``nvidia.com/gpu``, ``nvidia_com_mig_1g_10gb`` ->
    ``nvidia.com/mig-1g.10gb``, ``nvidia_com_gpu_10gb`` -> ``nvidia.com/gpu-10gb``.  Other
    labels come back unchanged (``cpu``, ``memory``, ``nvidia_com_gpu_shared``): their original
    spelling cannot be known.
    """
    if label == "nvidia_com_gpu":
        return WHOLE_GPU
    m = _KSM_MPS.match(label)
    if m:
        return mps_resource(int(m.group("gb")))
    m = _KSM_MIG.match(label)
    if m:
        resource = MIG_RESOURCE_PREFIX + m.group("rest").replace("_", ".")
        if classify(resource) == MIG:
            return resource
    return label


def ksm_label_of(resource: str) -> str:
    """The label kube-state-metrics writes for ``resource`` (its sanitising rule)."""
    return _KSM_INVALID.sub("_", resource)


def parse_resource_map(entries: Iterable[str]) -> dict[str, str | None]:
    """``FROM=TO`` entries -> {FROM: TO}; ``FROM=`` (empty TO) drops ``FROM`` (``None``).

    ``FROM`` is any resource name as the source spells it (a kube-state-metrics label such as
    ``nvidia_com_gpu_shared`` too); ``TO`` must be a replayable name (:data:`ACCEPTED`).
    """
    out: dict[str, str | None] = {}
    for entry in entries:
        src, sep, dst = entry.partition("=")
        src, dst = src.strip(), dst.strip()
        if not sep or not src:
            raise ResourceMapError(
                f"--map-resource {entry!r}: expected FROM=TO, e.g. "
                "nvidia.com/gpu.shared=nvidia.com/gpu-10gb (an empty TO drops FROM)"
            )
        if dst and classify(dst) is None:
            raise ResourceMapError(f"--map-resource {entry!r}: {dst!r} is not one of {ACCEPTED}")
        if src in out:
            raise ResourceMapError(f"--map-resource: {src!r} is mapped twice; keep one")
        out[src] = dst or None
    return out


def apply_resource_map(
    resource: str, mapping: Mapping[str, str | None], raw: str | None = None
) -> str | None:
    """``resource`` renamed by ``mapping`` (looked up by name, then by its source spelling
    ``raw``); ``None`` when the map drops it."""
    for key in (resource, raw):
        if key is not None and key in mapping:
            return mapping[key]
    return resource
