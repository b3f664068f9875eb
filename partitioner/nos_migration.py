"""What changes for a cluster's pods and nodes when gpuslice replaces nos. Pure.

Model
-----
MIG resources mean the same under both (``nvidia.com/mig-<profile>``, exact names).  MPS
resources do not (shared/facts/gpu-operator.md section 5, nos.md):

* **nos** sizes ``nvidia.com/gpu-<N>gb`` as ``N`` x 1000 MiB and lets one GPU's slices add up
  to ``ceil(memory MiB / 1000)`` "GB", with no memory kept for the MPS server: ``k_nos =
  floor(ceil(M / 1000) / N)`` such slices fit a GPU of ``M`` MiB;
* **gpuslice** sizes it as ``N`` x 1024 MiB and keeps ``reserve`` MiB (512 by default) for the
  MPS server: ``k = floor((M - reserve) / (N x 1024))``.

So every MPS pod gets 2.4 % more memory than nos gave it, and on some GPUs fewer of them fit
(4 x ``gpu-10gb`` on an A100-40GB under nos, 3 under gpuslice).  :func:`check` lists every pod
that requests an MPS slice with both meanings, per GPU model it can run on (its node's, or
every MPS node's model for a pending pod) how many fit under each, and -- where fewer fit --
the request that keeps nos's packing: the largest ``nvidia.com/gpu-<M>gb`` with ``k >= k_nos``.
It also lists nodes still carrying nos's annotations or its device-plugin config label.

gpuslice offers this check instead of a nos-compatible size mode (README design notes): a
mode without the server reserve would bring back nos issues #39 and #47, and ``gpu-10gb``
would mean two sizes in one cluster.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from contract.quantity import ascii_count
from partitioner.adoption import NOS_STATUS_PREFIX
from partitioner.quantities import QuantityError, pod_requests
from partitioner.snapshot import ClusterReading, pod_key
from planner.demand import MIB_PER_GIB
from planner.snapshot import Mode, mps_gb_of, mps_resource

__all__ = ["NOS_DEVICE_PLUGIN_LABEL", "MpsFit", "NodeNote", "PodChange", "check", "fits"]

NOS_DEVICE_PLUGIN_LABEL = "nvidia.com/device-plugin.config"
NOS_MIB_PER_GB = 1000
NOS_SCHEDULER = "nos-scheduler"
"""The scheduler nos's chart installs (its elastic quotas need pods to name it)."""

Obj = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class MpsFit:
    """How many ``gpu-<N>gb`` slices fit one GPU of a model under nos and under gpuslice."""

    model: str
    gpu_memory_mib: int
    nos: int
    gpuslice: int
    keep_with: int | None
    """The largest ``<M>gb`` of which at least ``nos`` fit under gpuslice (only when fewer
    fit); ``None`` if none does or nothing changes."""


@dataclass(frozen=True, slots=True)
class PodChange:
    pod: str
    resource: str
    node: str
    """The node it runs on, or ``""`` for a pending pod."""
    nos_mib: int
    gpuslice_mib: int
    fits: tuple[MpsFit, ...]
    refused: str = ""
    """Why gpuslice can never place the pod as it asks (``nvidia.com/gpu-10gb: 2``: two MPS
    slices, which nos summed into one), or ``""``: then no size fix applies."""

    @property
    def fewer_fit(self) -> bool:
        return any(f.gpuslice < f.nos for f in self.fits)

    def describe(self) -> str:
        where = f"on node {self.node}" if self.node else "pending"
        lines = [
            f"{self.pod} ({where}): {self.resource} means {self.nos_mib} MiB under nos, "
            f"{self.gpuslice_mib} MiB under gpuslice"
        ]
        if self.refused:
            lines.append(f"  gpuslice refuses the pod as it asks: {self.refused}")
            return "\n".join(lines)
        for f in self.fits:
            per = f"per {f.model} GPU ({f.gpu_memory_mib} MiB): {f.nos} fit under nos, {f.gpuslice} under gpuslice"
            if f.gpuslice >= f.nos:
                lines.append(f"  {per}: nothing to do")
            elif f.keep_with is not None:
                mib = f.keep_with * MIB_PER_GIB
                lines.append(
                    f"  {per}: to keep {f.nos} per GPU request {mps_resource(f.keep_with)} "
                    f"({mib} MiB, {100 * (self.nos_mib - mib) / self.nos_mib:.1f} % less than nos gave)"
                )
            else:
                lines.append(
                    f"  {per}: no gpuslice size fits {f.nos} per GPU; plan for {f.gpuslice}"
                )
        if not self.fits:
            lines.append("  no opted-in MPS node with readable GPU labels to compare on")
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class NodeNote:
    node: str
    message: str


def fits(gb: int, gpu_memory_mib: int, reserve_mib: int, model: str = "") -> MpsFit:
    """``gpu-<gb>gb`` slices per GPU of ``gpu_memory_mib`` under nos and gpuslice (module docstring)."""
    nos = math.ceil(gpu_memory_mib / NOS_MIB_PER_GB) // gb
    usable = max(0, gpu_memory_mib - reserve_mib)
    ours = usable // (gb * MIB_PER_GIB)
    keep: int | None = None
    if ours < nos and nos > 0:
        best = usable // (nos * MIB_PER_GIB)
        keep = best if best >= 1 else None
    return MpsFit(model, gpu_memory_mib, nos, ours, keep)


def _mps_resources(pod: Obj) -> list[str]:
    """The MPS resources (``nvidia.com/gpu-<N>gb``, N >= 1) a pod asks at least one of."""
    try:
        requests = pod_requests(pod)
    except QuantityError:
        return []
    return sorted(r for r, v in requests.items() if (mps_gb_of(r) or 0) > 0 and v > 0)


_NOS_MPS_STATUS = re.compile(
    r"^nos\.nebuly\.com/status-gpu-([0-9]{1,18})-([0-9]{1,18})gb-(used|free)$"
)


def _packings(nodes: Sequence[Obj], reading: ClusterReading, reserve_mib: int) -> list[NodeNote]:
    """MPS GPUs whose slices under nos (its status annotations, per GPU) add up to more than
    gpuslice gives one GPU: each size alone may fit both ways, a mix of sizes not (5 x
    ``gpu-7gb`` + 1 x ``gpu-6gb`` is 41 "GB" under nos, 41 GiB against 39.5 under gpuslice)."""
    out: list[NodeNote] = []
    for obj in sorted(nodes, key=lambda n: str((n.get("metadata") or {}).get("name", ""))):
        meta = obj.get("metadata") or {}
        name = str(meta.get("name", ""))
        g = reading.gpu_nodes.get(name)
        if g is None or g.mode is not Mode.MPS:
            continue
        usable = max(0, (g.gpu_memory_mib or g.model.memory_mib) - reserve_mib)
        per_gpu: dict[int, int] = {}
        for key, value in (meta.get("annotations") or {}).items():
            m = _NOS_MPS_STATUS.match(str(key))
            count = ascii_count(str(value))
            if m is None or count is None:
                continue
            gpu, gb = int(m.group(1)), int(m.group(2))
            per_gpu[gpu] = per_gpu.get(gpu, 0) + gb * MIB_PER_GIB * min(count, 1024)
        for gpu, mib in sorted(per_gpu.items()):
            if mib > usable:
                out.append(
                    NodeNote(
                        name,
                        f"GPU {gpu}: nos's slices there add up to {mib} MiB under gpuslice's "
                        f"sizes, more than the {usable} MiB it gives a GPU beside the MPS server: "
                        f"they will not all fit together again; ask "
                        f"{math.ceil((mib - usable) / MIB_PER_GIB)} GiB less in all there (one "
                        "pod a size smaller each GiB), or plan for fewer per GPU",
                    )
                )
    return out


def check(
    pods: Sequence[Obj], nodes: Sequence[Obj], reading: ClusterReading, reserve_mib: int
) -> tuple[list[PodChange], list[NodeNote]]:
    """Every MPS pod whose meaning changes, and the nodes still marked by nos (module docstring)."""
    memory = {
        name: (g.model.name, g.gpu_memory_mib or g.model.memory_mib)
        for name, g in reading.gpu_nodes.items()
    }
    mps_models = sorted({memory[n] for n, g in reading.gpu_nodes.items() if g.mode is Mode.MPS})
    changes: list[PodChange] = []
    for pod in sorted(pods, key=pod_key):
        phase = (pod.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            continue
        node = str((pod.get("spec") or {}).get("nodeName") or "")
        targets = [memory[node]] if node in memory else ([] if node else mps_models)
        refused = reading.rejected.get(pod_key(pod), "")
        for resource in _mps_resources(pod):
            gb = mps_gb_of(resource) or 0
            changes.append(
                PodChange(
                    pod_key(pod),
                    resource,
                    node,
                    gb * NOS_MIB_PER_GB,
                    gb * MIB_PER_GIB,
                    tuple(fits(gb, mib, reserve_mib, model) for model, mib in targets),
                    refused,
                )
            )
    notes: list[NodeNote] = [
        NodeNote(name, f"left out of plans: {problem.reason}: {problem.message}")
        for name, problem in sorted(reading.problems.items())
    ]
    notes += _packings(nodes, reading, reserve_mib)
    scheduler = sorted(
        pod_key(pod)
        for pod in pods
        if (pod.get("spec") or {}).get("schedulerName") == NOS_SCHEDULER
        and not (pod.get("spec") or {}).get("nodeName")
        and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
    )
    if scheduler:
        notes.append(
            NodeNote(
                "(pods)",
                f"{len(scheduler)} pending pod(s) name schedulerName {NOS_SCHEDULER} "
                f"({', '.join(scheduler[:5])}{', ...' if len(scheduler) > 5 else ''}), which "
                "leaves with nos: nothing would bind them; recreate them without schedulerName "
                "(kube-scheduler binds what gpuslice plans)",
            )
        )
    for obj in sorted(nodes, key=lambda n: str((n.get("metadata") or {}).get("name", ""))):
        meta = obj.get("metadata") or {}
        name = str(meta.get("name", ""))
        annotations: Mapping[str, str] = meta.get("annotations") or {}
        labels: Mapping[str, str] = meta.get("labels") or {}
        nos_keys = sorted(k for k in annotations if k.startswith("nos.nebuly.com/"))
        if nos_keys:
            status = sum(1 for k in nos_keys if k.startswith(NOS_STATUS_PREFIX))
            notes.append(
                NodeNote(
                    name,
                    f"{len(nos_keys)} nos annotation(s) ({status} status-gpu-*): on MIG nodes "
                    f"gpuslice reads the status ones to adopt instances until its agent reports; "
                    f"remove them all after that (docs/operations.md, 'Migrate from nos')",
                )
            )
        if NOS_DEVICE_PLUGIN_LABEL in labels:
            notes.append(
                NodeNote(
                    name,
                    f"label {NOS_DEVICE_PLUGIN_LABEL}={labels[NOS_DEVICE_PLUGIN_LABEL]} selects nos's "
                    f"device-plugin fork config: remove it with the fork",
                )
            )
    return changes, notes
