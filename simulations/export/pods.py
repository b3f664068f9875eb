"""A workload file from what a cluster recorded about its pods, in the cluster's own resource names.

Model
-----
A source reader -- :mod:`simulations.export.kubectl` (``kubectl get pods -A -o json`` dumps
taken over time) or :mod:`simulations.export.ksm` (kube-state-metrics series) -- turns its files
into :class:`ObservedPod` records: per pod (one per uid; ``namespace/name`` where the source
has no uid) the times the source shows, its effective requests per resource, its priority and
QoS class, and when the pod was first and last seen.  :func:`build_workload` turns those into a
:class:`~simulations.inputs.workload.Workload` with these decisions:

* **GPU requests** keep the cluster's names (:mod:`simulations.inputs.gpu_resources`): MIG profiles
  and MPS sizes become :attr:`Pod.slices` (replayed exactly as named), ``nvidia.com/gpu``
  becomes ``num_gpu`` whole GPUs.  A ``--map-resource FROM=TO`` entry renames (or, with an
  empty ``TO``, drops) a resource first.  Any other ``nvidia.com/`` name is an error naming the
  pod and the map entry that fixes it.  Resources of other domains are not GPU requests.
* **Slice names are exact** (kube-scheduler matches them so; gpuslice's agent advertises
  canonical names only, :mod:`planner.snapshot`): a slice name that is a near miss of a
  canonical one -- ``nvidia.com/gpu-010gb``, ``nvidia.com/mig-1G.10GB``,
  ``nvidia.com/mig-1g.10gb.shared`` (NVIDIA's time-slicing rename), kube-state-metrics'
  ``nvidia_com_gpu_010gb`` -- is an error naming the pod, the canonical name it most likely
  means (:meth:`planner.catalog.Catalog.near_miss` over the built-in catalog) and the
  ``--map-resource FROM=TO`` that renames it; so is a ``--map-resource`` ``TO`` that is such a
  near miss.  The partitioner rejects such pods the same way (:mod:`partitioner.rejection`).
* **Pods without a GPU request** are skipped and counted (:attr:`ExportReport.skipped_no_gpu`).
* **Arrival** is the creation time; a pod whose source has none (kube-state-metrics without
  ``kube_pod_created``) arrives when first seen, and is counted.
* **Scheduled** (reported, not replayed: the replay schedules on its own) is the PodScheduled
  condition's transition to True, else the pod's start time.
* **End**, in this order: the last container's ``finishedAt`` (or the first observation that
  shows the pod Succeeded/Failed) -- *finished*; ``metadata.deletionTimestamp`` -- *deleted*;
  the last observation that still showed a pod later observations lack -- *vanished* (a lower
  bound: it went between two observations); otherwise the end of the observation, with
  ``running: true`` -- *running*.  An end before the arrival (clock skew) is the arrival.
* **Times** are whole seconds from ``time_zero``, the earliest arrival of an exported pod.
* **Names** are ``namespace/name``; a name the cluster reused for a later pod (another uid)
  gets ``#2``, ``#3`` ... in arrival order.

Problems are collected over all pods and raised together (:class:`ExportError`, up to
:data:`MAX_LISTED` named, the rest counted): nothing is dropped silently.

The document :func:`workload_document` writes is the workload format of
:mod:`simulations.inputs.workload` plus ``time_zero`` and an ``export`` block (what was read, skipped,
mapped and how ends were decided); ``gpuslice simulate --trace`` and ``gpuslice sweep --trace``
read it as it is.
"""

from __future__ import annotations

import datetime
import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import yaml

from planner.catalog import default_catalog
from planner.snapshot import MIG_RESOURCE_PREFIX, canonical_mps_resource, mps_near_miss
from simulations.inputs.gpu_resources import (
    WHOLE,
    WHOLE_GPU,
    apply_resource_map,
    classify,
    is_gpu_resource,
    ksm_label_of,
)
from simulations.inputs.limits import MAX_PODS, MAX_TIME_S
from simulations.inputs.workload import (
    GPU_MILLI,
    MAX_SLICES_PER_POD,
    Pod,
    Workload,
    clip,
    pod_entry,
)

__all__ = [
    "END_DELETED",
    "END_FINISHED",
    "END_RUNNING",
    "END_VANISHED",
    "MAX_LISTED",
    "ExportError",
    "ExportReport",
    "ObservedPod",
    "build_workload",
    "format_time",
    "parse_time",
    "render",
    "split_at",
    "time_error",
    "time_from_name",
    "workload_document",
]

END_FINISHED = "finished"
END_DELETED = "deleted"
END_VANISHED = "vanished"
END_RUNNING = "running"
MAX_LISTED = 10
"""Problems named in one :class:`ExportError`; the rest are counted."""
FIRST_TIME_S = datetime.datetime.min.replace(tzinfo=datetime.UTC).timestamp()
"""0001-01-01T00:00:00Z in epoch seconds: the earliest time a timestamp can name."""
LAST_TIME_S = datetime.datetime.max.replace(tzinfo=datetime.UTC).timestamp() - 1.0
"""9999-12-31T23:59:59Z in epoch seconds (about 2.5e11): the latest."""


class ExportError(ValueError):
    """The sources cannot be exported as they are; the message names the file or pod and the fix."""


# --------------------------------------------------------------------------- times


def parse_time(text: object) -> float | None:
    """RFC 3339 (``2026-11-23T10:00:00Z``, fractions and offsets too) -> epoch seconds."""
    if not isinstance(text, str) or not text:
        return None
    try:
        stamp = datetime.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=datetime.UTC)
    return stamp.timestamp()


def time_error(value: float, what: str) -> str:
    """A problem with epoch seconds ``value`` (``what`` names it), or ``""`` for a time
    :func:`format_time` can write (years 1 to 9999)."""
    if math.isfinite(value) and FIRST_TIME_S <= value <= LAST_TIME_S:
        return ""
    return (
        f"{what} is {value:g}, not a time in epoch seconds between years 1 and 9999 "
        f"({FIRST_TIME_S:.0f} .. {LAST_TIME_S:.0f})"
    )


def format_time(epoch: float) -> str:
    """Epoch seconds (within :func:`time_error`'s range) -> ``2026-11-23T10:00:00Z``."""
    stamp = datetime.datetime.fromtimestamp(epoch, datetime.UTC).replace(microsecond=0)
    return stamp.isoformat().replace("+00:00", "Z")


_NAME_STAMP = re.compile(
    r"(?P<y>\d{4})-?(?P<mo>\d{2})-?(?P<d>\d{2})T(?P<h>\d{2})[:-]?(?P<mi>\d{2})[:-]?(?P<s>\d{2})Z"
)


def time_from_name(path: str) -> float | None:
    """The UTC time a file name carries (``pods-20261123T100000Z.json``, ``...2026-11-23T10-00-00Z``)."""
    m = _NAME_STAMP.search(path.rsplit("/", 1)[-1])
    if m is None:
        return None
    return parse_time("{y}-{mo}-{d}T{h}:{mi}:{s}Z".format(**m.groupdict()))


def split_at(spec: str) -> tuple[str, float | None]:
    """``FILE@TIME`` -> (FILE, epoch seconds); ``FILE`` -> (FILE, the time in its name or None).

    TIME is RFC 3339 (``2026-11-23T10:00:00Z``) or epoch seconds.  A suffix after the last ``@``
    that is neither is part of the file name.  Without ``@TIME``, a UTC stamp in the file name
    (``pods-20261123T100000Z.json``, as ``date -u +%Y%m%dT%H%M%SZ`` writes it) is the time.
    """
    path, sep, when = spec.rpartition("@")
    if not sep or not path:
        return spec, time_from_name(spec)
    t = parse_time(when)
    if t is None:
        try:
            t = float(when)
        except ValueError:
            return spec, time_from_name(spec)
        if not math.isfinite(t) or t < 0:
            return spec, time_from_name(spec)
        problem = time_error(t, f"the time of {path}@{when}")
        if problem:
            raise ExportError(f"{problem}; name it as {path}@2026-11-23T10:00:00Z")
    return path, t


# --------------------------------------------------------------------------- observations


@dataclass(slots=True)
class ObservedPod:
    """What one source says about one pod (times in epoch seconds)."""

    namespace: str
    name: str
    uid: str
    where: str
    """The file and item the pod was last read from, for messages."""
    first_seen: float
    last_seen: float
    created: float | None = None
    scheduled: float | None = None
    finished: float | None = None
    """When its containers had all terminated (or the pod was first seen finished)."""
    deleted: float | None = None
    requests: dict[str, Decimal] = field(default_factory=dict)
    """Effective request per resource name (the scheduler's rule: containers summed, init
    containers' maximum, overhead added)."""
    source_names: dict[str, str] = field(default_factory=dict)
    """resource -> the spelling the source used, where it differs (kube-state-metrics labels)."""
    renamed_from: dict[str, str] = field(default_factory=dict)
    """resource -> the name the pod asked for, where the reader knows better (``nvidia.com/gpu``
    on a GFD single-strategy node is a MIG device); reported as renamed."""
    cpu_milli: int = 0
    memory_mib: int = 0
    priority: int = 0
    qos: str = ""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(slots=True)
class ExportReport:
    """What an export read, skipped, mapped and decided (the ``export`` block, and stderr)."""

    source: str
    files: list[str]
    observation_end: float = 0.0
    time_zero: float = 0.0
    exported: int = 0
    ends: Counter[str] = field(default_factory=Counter)
    skipped_no_gpu: int = 0
    other_objects: int = 0
    """Objects that are not pods (Nodes of a ``kubectl get nodes,pods`` dump ...)."""
    renamed: Counter[str] = field(default_factory=Counter)
    """``FROM -> TO`` -> pods renamed by ``--map-resource`` (or by GFD's single strategy)."""
    dropped: Counter[str] = field(default_factory=Counter)
    """resource -> pods whose request ``--map-resource FROM=`` dropped."""
    arrival_first_seen: int = 0
    whole_gpu_pods: int = 0
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "source": self.source,
            "files": list(self.files),
            "observed_until": format_time(self.observation_end),
            "pods": self.exported,
            "ends": dict(sorted(self.ends.items())),
            "skipped_without_gpu_request": self.skipped_no_gpu,
        }
        if self.other_objects:
            d["other_objects"] = self.other_objects
        if self.renamed:
            d["renamed"] = dict(sorted(self.renamed.items()))
        if self.dropped:
            d["dropped"] = dict(sorted(self.dropped.items()))
        if self.arrival_first_seen:
            d["arrival_from_first_sample"] = self.arrival_first_seen
        if self.notes:
            d["notes"] = list(self.notes)
        return d

    def lines(self) -> list[str]:
        """The report in words (``gpuslice export`` prints it on stderr)."""
        ends = ", ".join(f"{n} {k}" for k, n in sorted(self.ends.items())) or "none"
        out = [
            f"exported {self.exported} GPU pod(s) from {len(self.files)} {self.source} "
            f"file(s), {format_time(self.time_zero)} .. {format_time(self.observation_end)} "
            f"({self.observation_end - self.time_zero:,.0f} s); ends: {ends}",
            f"skipped {self.skipped_no_gpu} pod(s) without a GPU request"
            + (
                f" and {self.other_objects} object(s) that are not pods"
                if self.other_objects
                else ""
            ),
        ]
        out += [f"renamed {r} in {n} pod(s)" for r, n in sorted(self.renamed.items())]
        out += [f"dropped {r} from {n} pod(s)" for r, n in sorted(self.dropped.items())]
        if self.arrival_first_seen:
            out.append(
                f"{self.arrival_first_seen} pod(s) had no creation time: they arrive when first "
                "seen (export kube_pod_created too)"
            )
        out += [f"note: {n}" for n in self.notes]
        return out


# --------------------------------------------------------------------------- workload


def _count(resource: str, amount: Decimal, pod: ObservedPod) -> tuple[int, str]:
    """``amount`` as a device count, or a problem."""
    if amount != amount.to_integral_value() or not 0 <= amount <= MAX_SLICES_PER_POD:
        return 0, (
            f"pod {clip(pod.key)} ({pod.where}) requests {amount} of {resource}; a device count "
            f"is a whole number 0..{MAX_SLICES_PER_POD}"
        )
    return int(amount), ""


def canonical_slice_name(resource: str) -> str | None:
    """The canonical slice name a near miss most likely means (``nvidia.com/gpu-010gb`` ->
    ``nvidia.com/gpu-10gb``, ``nvidia.com/mig-1G.10GB`` -> ``nvidia.com/mig-1g.10gb``);
    ``None`` for a canonical name, one that is no slice name, or one nothing is close to."""
    if canonical_mps_resource(resource) is not None:  # an MPS slice name
        return mps_near_miss(resource)
    if resource.startswith(MIG_RESOURCE_PREFIX):
        near = default_catalog().near_miss(resource)
        return near.resource if near is not None else None
    return None


def _misnamed(pod: ObservedPod, resource: str, raw: str | None, mapped: str, explicit: bool) -> str:
    """A problem if the slice name the replay would use is not canonical (module docstring),
    else ``""``.  ``explicit``: ``--map-resource`` named this resource (check its ``TO``)."""
    asked = raw or resource
    exact = "Kubernetes matches extended resource names exactly, case included"
    if explicit:
        fix = canonical_slice_name(mapped)
        if fix is None:
            return ""
        return (
            f"pod {clip(pod.key)} ({pod.where}) requests {asked}, which --map-resource renames "
            f"to {mapped}, a slice name gpuslice's nodes never advertise ({exact}); did you "
            f"mean {fix}? Use --map-resource {asked}={fix}"
        )
    fix = canonical_slice_name(resource)
    if fix is None and raw is not None and ksm_label_of(resource) != raw:
        fix = resource  # kube-state-metrics' label spells another name (nvidia_com_gpu_010gb)
    if fix is None:
        return ""
    return (
        f"pod {clip(pod.key)} ({pod.where}) requests {asked}, a slice name gpuslice's nodes "
        f"never advertise ({exact}); did you mean {fix}? Rename it with --map-resource "
        f"{asked}={fix}"
    )


def _gpu_requests(
    pod: ObservedPod, resource_map: Mapping[str, str | None], report: ExportReport
) -> tuple[int, dict[str, int], list[str]]:
    """(whole GPUs, slices, problems) of one pod after the resource map."""
    whole = 0
    slices: dict[str, int] = {}
    problems: list[str] = []
    for resource, original in pod.renamed_from.items():
        report.renamed[f"{original} -> {resource} (GFD single MIG strategy)"] += 1
    for resource, amount in sorted(pod.requests.items()):
        raw = pod.source_names.get(resource)
        mapped = apply_resource_map(resource, resource_map, raw)
        if mapped is None:
            report.dropped[raw or resource] += 1
            continue
        if mapped != resource:
            report.renamed[f"{raw or resource} -> {mapped}"] += 1
        if not is_gpu_resource(mapped) and not is_gpu_resource(resource):
            continue
        explicit = resource in resource_map or (raw is not None and raw in resource_map)
        misnamed = _misnamed(pod, resource, raw, mapped, explicit)
        if misnamed:
            problems.append(misnamed)
            continue
        kind = classify(mapped)
        if kind is None:
            problems.append(
                f"pod {clip(pod.key)} ({pod.where}) requests {raw or resource}, a GPU resource the "
                f"simulator cannot replay: rename it with --map-resource {raw or resource}=TO "
                "(TO: nvidia.com/mig-<profile>, nvidia.com/gpu-<N>gb or nvidia.com/gpu) or drop "
                f"it with --map-resource {raw or resource}="
            )
            continue
        count, problem = _count(mapped, amount, pod)
        if problem:
            problems.append(problem)
        elif count == 0:
            continue
        elif kind == WHOLE:
            whole += count
        else:
            slices[mapped] = slices.get(mapped, 0) + count
    if whole and slices:
        problems.append(
            f"pod {clip(pod.key)} ({pod.where}) requests whole GPUs ({WHOLE_GPU}: {whole}) and "
            f"slices ({', '.join(sorted(slices))}) at once; the simulator replays one or the "
            f"other: drop one with --map-resource {WHOLE_GPU}="
        )
    return whole, slices, problems


def _end(pod: ObservedPod, observation_end: float) -> tuple[float, str]:
    if pod.finished is not None:
        return pod.finished, END_FINISHED
    if pod.deleted is not None:
        return pod.deleted, END_DELETED
    if pod.last_seen < observation_end:
        return pod.last_seen, END_VANISHED
    return observation_end, END_RUNNING


_TIMES = (
    ("created", "creation time"),
    ("scheduled", "scheduled time"),
    ("finished", "finish time"),
    ("deleted", "deletion time"),
    ("first_seen", "first sample time"),
    ("last_seen", "last sample time"),
)


def _time_problems(pod: ObservedPod) -> list[str]:
    """Problems with the times a source gave ``pod`` (each within :func:`time_error`'s range)."""
    problems = []
    for attr, what in _TIMES:
        value = getattr(pod, attr)
        problem = "" if value is None else time_error(value, f"its {what}")
        if problem:
            problems.append(f"pod {clip(pod.key)} ({pod.where}): {problem}")
    return problems


def _raise(problems: Sequence[str]) -> None:
    if problems:
        more = len(problems) - MAX_LISTED
        raise ExportError(
            f"{len(problems)} problem(s): "
            + "; ".join(problems[:MAX_LISTED])
            + (f"; and {more} more" if more > 0 else "")
        )


def build_workload(
    observed: Iterable[ObservedPod],
    observation_end: float,
    report: ExportReport,
    name: str,
    resource_map: Mapping[str, str | None] | None = None,
) -> Workload:
    """The GPU pods of ``observed`` as a workload (module docstring); fills ``report``."""
    rmap = resource_map or {}
    rows: list[tuple[float, ObservedPod, int, dict[str, int]]] = []
    problems: list[str] = []
    for pod in observed:
        whole, slices, pod_problems = _gpu_requests(pod, rmap, report)
        pod_problems += _time_problems(pod)
        problems += pod_problems
        if pod_problems:
            continue
        if not whole and not slices:
            report.skipped_no_gpu += 1
            continue
        arrival = pod.created
        if arrival is None:
            arrival = pod.first_seen
            report.arrival_first_seen += 1
        rows.append((arrival, pod, whole, slices))
    _raise(problems)
    if not rows:
        raise ExportError(
            f"no pod in {', '.join(report.files)} requests an NVIDIA GPU resource "
            f"({report.skipped_no_gpu} pod(s) read, none with nvidia.com/gpu, "
            "nvidia.com/mig-<profile> or nvidia.com/gpu-<N>gb); nothing to export"
        )
    if len(rows) > MAX_PODS:
        raise ExportError(f"{len(rows):,} GPU pods; a workload holds at most {MAX_PODS:,}")
    problem = time_error(observation_end, "the end of the observation (the last sample)")
    if problem:
        raise ExportError(f"{', '.join(report.files)}: {problem}")
    rows.sort(key=lambda r: (r[0], r[1].key, r[1].uid))
    t0 = math.floor(min(r[0] for r in rows))
    report.time_zero = float(t0)
    report.observation_end = max(observation_end, float(t0))
    uses: Counter[str] = Counter()
    pods: list[Pod] = []
    for arrival, pod, whole, slices in rows:
        uses[pod.key] += 1
        pod_name = pod.key if uses[pod.key] == 1 else f"{pod.key}#{uses[pod.key]}"
        end, reason = _end(pod, report.observation_end)
        latest = max(end, arrival, arrival if pod.scheduled is None else pod.scheduled) - t0
        if latest > MAX_TIME_S:  # the workload file would not load
            problems.append(
                f"pod {clip(pod.key)} ({pod.where}) has a time {latest:,.0f} s after time_zero "
                f"({format_time(t0)}), past the simulator's limit of {MAX_TIME_S:,} s; export "
                "a shorter window"
            )
            continue
        report.ends[reason] += 1
        creation = round(arrival - t0)
        scheduled = None
        if pod.scheduled is not None:
            scheduled = max(creation, round(pod.scheduled - t0))
        report.whole_gpu_pods += 1 if whole else 0
        pods.append(
            Pod(
                name=pod_name,
                cpu_milli=pod.cpu_milli,
                memory_mib=pod.memory_mib,
                num_gpu=whole,
                gpu_milli=GPU_MILLI if whole else 0,
                qos=pod.qos,
                creation_time=creation,
                deletion_time=max(creation, round(end - t0)),
                scheduled_time=scheduled,
                slices=tuple(sorted(slices.items())),
                priority=pod.priority,
                running=reason == END_RUNNING,
            )
        )
    _raise(problems)
    report.exported = len(pods)
    if report.whole_gpu_pods:
        report.notes.append(
            f"{report.whole_gpu_pods} pod(s) request {WHOLE_GPU} (whole GPUs): the replay gives "
            "each GPU the model's largest MIG profile (mig nodes) or an MPS slice of all its "
            "memory (mps nodes). Under GPU Feature Discovery's single MIG strategy "
            f"{WHOLE_GPU} is a MIG device: "
            + (
                "include the nodes in the dump (kubectl get nodes,pods -A -o json) or "
                if report.source == "kubectl"
                else ""
            )
            + f"pass --map-resource {WHOLE_GPU}=nvidia.com/mig-<profile>"
        )
    return Workload(name=name, pods=tuple(pods), source=", ".join(report.files))


# --------------------------------------------------------------------------- document


def workload_document(workload: Workload, report: ExportReport) -> dict[str, Any]:
    """The workload file (:mod:`simulations.inputs.workload` format) with ``time_zero`` and ``export``."""
    return {
        "name": workload.name,
        "time_zero": format_time(report.time_zero),
        "export": report.as_dict(),
        "pods": [pod_entry(p) for p in workload.pods],
    }


def render(doc: Mapping[str, Any], fmt: str) -> str:
    """``doc`` as YAML (``yaml``) or JSON (``json``) text."""
    if fmt == "json":
        return json.dumps(doc, indent=2) + "\n"
    header = (
        "# Workload exported by `gpuslice export` (format: docs/workloads.md).\n"
        "# Replay it: gpuslice simulate --protocol time-replay --trace THIS_FILE --cluster CLUSTER.yaml\n"
    )
    return header + yaml.safe_dump(dict(doc), sort_keys=False, width=100)
