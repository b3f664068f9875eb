"""Pods and workloads for the simulator: the types, our YAML/JSON workload format, a seeded generator.

Model
-----
A :class:`Pod` is one request as the openb traces describe it: CPU (milli-cores), host memory
(MiB), ``num_gpu`` GPUs each shared at ``gpu_milli`` thousandths (1000 = the whole GPU), an
optional set of GPU models it may run on (``gpu_spec``; empty = any model), a QoS class and
optional times in seconds (creation, deletion, scheduled; the saturation protocol ignores them,
the time-replay protocol uses them).

A pod exported from a real cluster (:mod:`simulations.export.pods`) asks instead for *slices by
name*: ``slices`` holds its exact extended-resource requests (``nvidia.com/mig-1g.10gb: 2``,
``nvidia.com/gpu-10gb: 1``), which the time replay passes to the cluster unchanged
(:mod:`simulations.inputs.workload_slices`), never through a gpu_milli mapping.  Whole-GPU requests
(``nvidia.com/gpu: N``) are ``num_gpu = N, gpu_milli = 1000``, as in the traces.  A pod also
carries its scheduling ``priority`` (``spec.priority``) and ``running`` (it was still running
or pending when the observation ended, so ``deletion_time`` is the end of the observation,
not the pod's end).

Invariants, enforced at construction:

* ``num_gpu == 0`` (CPU-only) implies ``gpu_milli == 0``;
* ``num_gpu >= 1`` implies ``1 <= gpu_milli <= 1000``;  a *sharing* pod has ``num_gpu == 1`` and
  ``gpu_milli < 1000``; everything else with GPUs takes whole GPUs;
* ``slices`` non-empty implies ``num_gpu == 0``; its names are MIG or MPS resource names
  (:func:`simulations.inputs.gpu_resources.classify`), each once, sorted, with counts ``>= 1``;
* a pod is *CPU-only* when it has neither GPUs nor slices.

Loaders normalise raw values the way the FGD simulator does (:func:`normalise_gpu_milli`):
``gpu_milli`` above 1000 is clipped to 1000, zero or below becomes 0, and a pod whose GPU count
is 0 or whose share is 0 is CPU-only.

A :class:`Workload` is a named, ordered tuple of pods with unique names.

Workload file format (YAML or JSON, same structure)
--------------------------------------------------
::

    name: my-workload            # optional, defaults to the file name
    pods:
      - name: train-0            # required, unique
        cpu_milli: 8000          # required, >= 0
        memory_mib: 16384        # optional, default 0
        num_gpu: 1               # optional, default 0 (CPU-only)
        gpu_milli: 500           # per GPU, 1..1000; required when num_gpu >= 1
        gpu_spec: [A100-SXM4-80GB, T4]   # optional list (or "A|B" string); empty = any model
        qos: LS                  # optional (LS, BE, Burstable, Guaranteed ...)
        creation_time: 0         # optional, seconds
        deletion_time: 3600      # optional, seconds, >= creation_time
        replicas: 3              # optional: expands to train-0-0, train-0-1, train-0-2
      - name: serving/llm-0      # a pod in the cluster's own resource names
        cpu_milli: 2000
        requests:                # instead of num_gpu/gpu_milli: GPU extended resources
          nvidia.com/mig-3g.40gb: 1      # MIG profile (or nvidia.com/gpu-10gb: MPS, GiB;
                                         # or nvidia.com/gpu: whole GPUs)
        priority: 1000           # optional, spec.priority (default 0)
        creation_time: 0
        scheduled_time: 4        # optional, seconds, >= creation_time (observed, reported)
        deletion_time: 7200
        running: true            # optional: still running when observed last

Top-level ``time_zero`` (the RFC 3339 time of second 0) and ``export`` (what
``gpuslice export`` read and skipped) are informational.  docs/workloads.md has the full
reference.  Every error names the file, the pod's position (``pods[3]``) and the field to fix.

Synthetic generator
-------------------
:func:`synthetic_workload` draws ``count`` pods from a :class:`SyntheticSpec`: Poisson arrivals
at ``arrival_rate_per_s``, a weighted size mix of :class:`PodShape` entries, and exponential
durations with mean ``mean_duration_s`` (minimum 1 s).  It uses only ``random.Random(seed)``,
so the same spec and seed give the same workload on every machine.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from contract.quantity import ascii_count
from planner.snapshot import MIG_RESOURCE_PREFIX
from simulations.inputs.documents import named_entry, read_document
from simulations.inputs.gpu_resources import ACCEPTED, WHOLE, classify, from_ksm_label
from simulations.inputs.limits import (
    MAX_CPU_MILLI,
    MAX_GPUS_PER_NODE,
    MAX_MEMORY_MIB,
    MAX_PODS,
    MAX_TIME_S,
)

__all__ = [
    "Pod",
    "PodShape",
    "SyntheticSpec",
    "Workload",
    "WorkloadError",
    "load_workload",
    "normalise_gpu_milli",
    "parse_gpu_requests",
    "parse_workload",
    "pod_entry",
    "synthetic_spec_from_doc",
    "synthetic_workload",
]

GPU_MILLI = 1000
"""Milli-units of one whole GPU."""
MAX_SLICES_PER_POD = 1024
"""Units of one resource one pod may request (a 64-GPU node holds at most 448 MIG devices)."""
MAX_PRIORITY = 2**31 - 1
"""Kubernetes priorities are int32."""


class WorkloadError(ValueError):
    """A workload file or trace is invalid; the message names the file, line or entry."""


MAX_NAME_SHOWN = 60
"""Characters of a name a message shows (a longer one is cut, with ``...``)."""


def clip(name: str) -> str:
    """``name`` for a message: cut to :data:`MAX_NAME_SHOWN` characters, then ``...``."""
    return name if len(name) <= MAX_NAME_SHOWN else f"{name[:MAX_NAME_SHOWN]}..."


@dataclass(frozen=True, slots=True)
class Pod:
    """One pod request (see the module docstring for the invariants)."""

    name: str
    cpu_milli: int
    memory_mib: int = 0
    num_gpu: int = 0
    gpu_milli: int = 0
    """Share of *each* GPU, in thousandths; the total request is ``num_gpu * gpu_milli``."""
    gpu_spec: tuple[str, ...] = ()
    """GPU models the pod may run on; empty means any model."""
    qos: str = ""
    creation_time: int | None = None
    deletion_time: int | None = None
    scheduled_time: int | None = None
    slices: tuple[tuple[str, int], ...] = ()
    """Exact extended-resource requests (resource, count), sorted by name; replayed as they are."""
    priority: int = 0
    """``spec.priority``: the scheduler's queue order and the planner's first objective."""
    running: bool = False
    """Still running (or pending) when the source was last observed: ``deletion_time`` is the
    end of the observation, not the pod's."""

    def __post_init__(self) -> None:
        if self.cpu_milli < 0 or self.memory_mib < 0 or self.num_gpu < 0:
            raise WorkloadError(
                f"pod {clip(self.name)!r}: cpu_milli, memory_mib and num_gpu must be >= 0 "
                f"(got {self.cpu_milli}, {self.memory_mib}, {self.num_gpu})"
            )
        if self.num_gpu == 0 and self.gpu_milli != 0:
            raise WorkloadError(
                f"pod {clip(self.name)!r}: a CPU-only pod (num_gpu 0) has gpu_milli 0"
            )
        if self.num_gpu > 0 and not 1 <= self.gpu_milli <= GPU_MILLI:
            raise WorkloadError(
                f"pod {clip(self.name)!r}: gpu_milli must be 1..1000 per GPU, got {self.gpu_milli}"
            )
        if (
            self.creation_time is not None
            and self.deletion_time is not None
            and self.deletion_time < self.creation_time
        ):
            raise WorkloadError(
                f"pod {clip(self.name)!r}: deletion_time {self.deletion_time} is before "
                f"creation_time {self.creation_time}"
            )
        if self.slices:
            self._check_slices()

    def _check_slices(self) -> None:
        if self.num_gpu:
            raise WorkloadError(
                f"pod {clip(self.name)!r}: requests both whole GPUs (num_gpu {self.num_gpu}) and "
                f"slices ({', '.join(r for r, _ in self.slices)}); the simulator replays a pod "
                "with one or the other: split it or drop one"
            )
        names = [r for r, _ in self.slices]
        if names != sorted(set(names)):
            raise WorkloadError(
                f"pod {clip(self.name)!r}: slices must name each resource once, sorted"
            )
        for resource, count in self.slices:
            if classify(resource) not in ("mig", "mps"):
                raise WorkloadError(
                    f"pod {clip(self.name)!r}: {resource!r} is not a MIG or MPS resource name"
                )
            if not 1 <= count <= MAX_SLICES_PER_POD:
                raise WorkloadError(
                    f"pod {clip(self.name)!r}: {resource} count must be 1..{MAX_SLICES_PER_POD}, "
                    f"got {count}"
                )

    @property
    def total_gpu_milli(self) -> int:
        """The pod's whole GPU request in milli-GPUs (``num_gpu * gpu_milli``); 0 for a pod that
        asks for slices by name (their share depends on the GPU model)."""
        return self.num_gpu * self.gpu_milli

    @property
    def is_cpu_only(self) -> bool:
        """Neither GPUs nor slices."""
        return self.num_gpu == 0 and not self.slices

    @property
    def slice_requests(self) -> dict[str, int]:
        """``slices`` as a mapping (resource -> count)."""
        return dict(self.slices)

    @property
    def is_sharing(self) -> bool:
        """One GPU, shared (``gpu_milli < 1000``)."""
        return self.num_gpu == 1 and self.gpu_milli < GPU_MILLI

    @property
    def shape(self) -> tuple[int, int, int, tuple[str, ...]]:
        """FGD's shape key: (cpu_milli, gpu_milli, num_gpu, gpu_spec); memory is not part of it."""
        return (self.cpu_milli, self.gpu_milli, self.num_gpu, self.gpu_spec)

    def allows_model(self, model: str) -> bool:
        return not self.gpu_spec or model in self.gpu_spec


def normalise_gpu_milli(num_gpu: int, gpu_milli: int) -> tuple[int, int]:
    """FGD's rules: clip the share to 0..1000; no GPUs or no share means a CPU-only pod."""
    gm = min(max(gpu_milli, 0), GPU_MILLI)
    if num_gpu <= 0 or gm == 0:
        return 0, 0
    return num_gpu, gm


def parse_gpu_spec(value: object) -> tuple[str, ...]:
    """``"A|B"``, a list, ``None``/NaN/empty -> tuple of model names (empty pieces dropped)."""
    if value is None:
        return ()
    if isinstance(value, float):  # NaN from a spreadsheet export
        return ()
    if isinstance(value, str):
        parts: Iterable[object] = value.split("|")
    elif isinstance(value, list | tuple):
        if not all(isinstance(p, str) for p in value):
            raise WorkloadError(f"gpu_spec must list model names (strings), got {value!r:.60}")
        parts = value
    else:
        raise WorkloadError(f"gpu_spec must be a 'A|B' string or a list, got {value!r}")
    out = tuple(str(p).strip() for p in parts if str(p).strip() and str(p).strip().lower() != "nan")
    return out


@dataclass(frozen=True, slots=True)
class Workload:
    """An ordered set of pods with unique names."""

    name: str
    pods: tuple[Pod, ...]
    source: str = ""
    """Where it came from (file path, ``synthetic(seed=...)``, or both)."""

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for p in self.pods:
            if p.name in seen:
                raise WorkloadError(
                    f"workload {clip(self.name)!r}: duplicate pod name {clip(p.name)!r}"
                )
            seen.add(p.name)

    @property
    def total_gpu_milli(self) -> int:
        return sum(p.total_gpu_milli for p in self.pods)

    def __len__(self) -> int:
        return len(self.pods)

    @property
    def slice_pods(self) -> tuple[Pod, ...]:
        """The pods that ask for slices by name (:attr:`Pod.slices`)."""
        return tuple(p for p in self.pods if p.slices)


# --------------------------------------------------------------------------- file format

_POD_FIELDS = {
    "name",
    "cpu_milli",
    "memory_mib",
    "num_gpu",
    "gpu_milli",
    "gpu_spec",
    "qos",
    "creation_time",
    "deletion_time",
    "scheduled_time",
    "replicas",
    "requests",
    "priority",
    "running",
}


_POD_MAX = {
    "cpu_milli": MAX_CPU_MILLI,
    "memory_mib": MAX_MEMORY_MIB,
    "num_gpu": MAX_GPUS_PER_NODE,
    "gpu_milli": MAX_CPU_MILLI,  # Pod itself requires 1..1000 and says so
    "replicas": MAX_PODS,
    "creation_time": MAX_TIME_S,
    "deletion_time": MAX_TIME_S,
    "scheduled_time": MAX_TIME_S,
    "priority": MAX_PRIORITY,
}
"""Upper bounds of the integer pod fields (simulations.inputs.limits)."""


def _int_field(d: Mapping[str, Any], key: str, where: str, default: int | None) -> int | None:
    """``d[key]`` as an int within ``0..`` its bound; ``default`` when absent or null."""
    if key not in d or d[key] is None:
        return default
    v = d[key]
    if (
        isinstance(v, bool)
        or not isinstance(v, int | float)
        or (isinstance(v, float) and not v.is_integer())
    ):
        raise WorkloadError(f"{where}: field {key!r} must be an integer, got {v!r:.60}")
    if not -_POD_MAX[key] <= v <= _POD_MAX[key]:
        raise WorkloadError(f"{where}: field {key!r} is {v:,.0f}; the limit is {_POD_MAX[key]:,}")
    return int(v)


def _str_field(d: Mapping[str, Any], key: str, where: str) -> str:
    v = d.get(key)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise WorkloadError(f"{where}: field {key!r} must be a string, got {v!r:.60}")
    return v


def _request_hint(resource: str) -> str:
    """A sentence that helps fix an unknown resource name, or ``""``."""
    if resource in ("cpu", "memory"):
        return " (CPU and memory go into cpu_milli and memory_mib, not requests)"
    restored = from_ksm_label(resource)
    if restored != resource:
        return f" (a kube-state-metrics label: the resource is {restored!r})"
    if resource.startswith(MIG_RESOURCE_PREFIX):
        return " (a MIG profile is spelled like 1g.10gb, 3g.40gb or 1g.10gb.me)"
    if resource.startswith(("mig-", "gpu-")):
        return f" (add the domain: 'nvidia.com/{resource}')"
    return ""


def parse_gpu_requests(value: object, where: str) -> tuple[int, tuple[tuple[str, int], ...]]:
    """A ``requests`` mapping -> (whole GPUs, sorted slices); errors name ``where`` and the fix.

    Keys are the names of :data:`simulations.inputs.gpu_resources.ACCEPTED`; values are integer
    counts ``>= 1`` (strings of digits too, as kubectl prints quantities).
    """
    if not isinstance(value, dict) or not value:
        raise WorkloadError(
            f"{where}: field 'requests' must map GPU resource names to counts, e.g. "
            "{nvidia.com/mig-1g.10gb: 1}"
        )
    whole = 0
    slices: list[tuple[str, int]] = []
    for resource, raw in value.items():
        kind = classify(str(resource))
        if kind is None:
            raise WorkloadError(
                f"{where}: requests: {resource!r} is not a GPU resource the simulator "
                f"replays{_request_hint(str(resource))}; use {ACCEPTED}"
            )
        digits = ascii_count(raw) if isinstance(raw, str) else None
        count = raw if digits is None else digits
        if isinstance(count, bool) or not isinstance(count, int):
            raise WorkloadError(
                f"{where}: requests: {resource} must be a whole number of devices, got {raw!r:.40}"
            )
        if not 1 <= count <= MAX_SLICES_PER_POD:
            raise WorkloadError(
                f"{where}: requests: {resource} is {count}; it must be 1..{MAX_SLICES_PER_POD} "
                "(remove a resource the pod does not request)"
            )
        if kind == WHOLE:
            whole = count
        else:
            slices.append((str(resource), count))
    return whole, tuple(sorted(slices))


def _parse_pod_entry(entry: object, where: str, room: int) -> list[Pod]:
    """The pods of one entry (``replicas`` expanded); ``room``: pods the workload may still add."""
    d, name, _ = named_entry(
        entry, _POD_FIELDS, where, WorkloadError, "with at least 'name' and 'cpu_milli'"
    )
    where = f"{where} ({clip(name)})"
    if "cpu_milli" not in d:
        raise WorkloadError(f"{where}: missing required field 'cpu_milli'")
    cpu = _int_field(d, "cpu_milli", where, 0)
    mem = _int_field(d, "memory_mib", where, 0)
    num_gpu = _int_field(d, "num_gpu", where, 0)
    gpu_milli = _int_field(d, "gpu_milli", where, 0)
    replicas = _int_field(d, "replicas", where, 1)
    assert cpu is not None and mem is not None and num_gpu is not None
    assert gpu_milli is not None and replicas is not None
    slices: tuple[tuple[str, int], ...] = ()
    if "requests" in d:
        if "num_gpu" in d or "gpu_milli" in d:
            raise WorkloadError(
                f"{where}: give either 'requests' (resource names) or 'num_gpu'/'gpu_milli' "
                "(GPU shares), not both"
            )
        num_gpu, slices = parse_gpu_requests(d["requests"], where)
        gpu_milli = GPU_MILLI if num_gpu else 0
    elif num_gpu > 0 and "gpu_milli" not in d:
        raise WorkloadError(f"{where}: num_gpu is {num_gpu}, so 'gpu_milli' (1..1000) is required")
    running = d.get("running", False)
    if not isinstance(running, bool):
        raise WorkloadError(f"{where}: field 'running' must be true or false, got {running!r:.40}")
    creation = _int_field(d, "creation_time", where, None)
    scheduled = _int_field(d, "scheduled_time", where, None)
    if scheduled is not None and (creation is None or scheduled < creation):
        raise WorkloadError(
            f"{where}: scheduled_time {scheduled} needs a creation_time at or before it "
            f"(creation_time is {creation})"
        )
    if replicas < 1:
        raise WorkloadError(f"{where}: replicas must be >= 1, got {replicas}")
    if replicas > room:
        raise WorkloadError(
            f"{where}: replicas {replicas:,} would take the workload past {MAX_PODS:,} pods"
        )
    qos = _str_field(d, "qos", where)
    deletion = _int_field(d, "deletion_time", where, None)
    priority = _int_field(d, "priority", where, 0)
    try:  # these errors do not name ``where`` yet
        spec = parse_gpu_spec(d.get("gpu_spec"))
        base = dict(
            cpu_milli=cpu,
            memory_mib=mem,
            num_gpu=num_gpu,
            gpu_milli=gpu_milli if num_gpu > 0 else 0,
            gpu_spec=spec,
            qos=qos,
            creation_time=creation,
            deletion_time=deletion,
            scheduled_time=scheduled,
            slices=slices,
            priority=priority,
            running=running,
        )
        if replicas == 1:
            return [Pod(name=name, **base)]  # type: ignore[arg-type]
        return [Pod(name=f"{name}-{i}", **base) for i in range(replicas)]  # type: ignore[arg-type]
    except WorkloadError as e:
        raise WorkloadError(f"{where}: {e}") from None


def parse_workload(doc: object, where: str, default_name: str = "workload") -> Workload:
    """Build a :class:`Workload` from a parsed YAML/JSON document (see the module docstring)."""
    if isinstance(doc, list):
        doc = {"pods": doc}
    if not isinstance(doc, dict) or "pods" not in doc:
        raise WorkloadError(
            f"{where}: expected a mapping with a 'pods' list (see simulations.inputs.workload)"
        )
    entries = doc["pods"]
    if not isinstance(entries, list) or not entries:
        raise WorkloadError(f"{where}: 'pods' must be a non-empty list")
    name = doc.get("name") or default_name
    if not isinstance(name, str):
        raise WorkloadError(f"{where}: field 'name' must be a string, got {name!r:.60}")
    total = 0  # replicas are counted before any pod is built
    for i, entry in enumerate(entries):
        if isinstance(entry, dict):
            where_i = f"{where}: pods[{i}] ({entry.get('name', '?')!s:.60})"
            total += _int_field(entry, "replicas", where_i, 1) or 0
            if total > MAX_PODS:
                raise WorkloadError(f"{where_i}: the workload has more than {MAX_PODS:,} pods")
    pods: list[Pod] = []
    for i, entry in enumerate(entries):
        pods.extend(_parse_pod_entry(entry, f"{where}: pods[{i}]", MAX_PODS - len(pods)))
    try:
        return Workload(name=name, pods=tuple(pods), source=where)
    except WorkloadError as e:
        raise WorkloadError(f"{where}: {e}") from None


def pod_entry(pod: Pod) -> dict[str, Any]:
    """One pod as a workload-file entry (the inverse of the parser; defaults left out).

    Whole-GPU pods are written as ``requests: {nvidia.com/gpu: N}``, sharing pods with
    ``num_gpu``/``gpu_milli``, pods with slices with their ``requests``.
    """
    d: dict[str, Any] = {"name": pod.name, "cpu_milli": pod.cpu_milli}
    if pod.memory_mib:
        d["memory_mib"] = pod.memory_mib
    if pod.slices:
        d["requests"] = dict(pod.slices)
    elif pod.num_gpu and pod.gpu_milli == GPU_MILLI:
        d["requests"] = {"nvidia.com/gpu": pod.num_gpu}
    elif pod.num_gpu:
        d["num_gpu"], d["gpu_milli"] = pod.num_gpu, pod.gpu_milli
    if pod.gpu_spec:
        d["gpu_spec"] = list(pod.gpu_spec)
    if pod.priority:
        d["priority"] = pod.priority
    if pod.qos:
        d["qos"] = pod.qos
    for key in ("creation_time", "scheduled_time", "deletion_time"):
        value = getattr(pod, key)
        if value is not None:
            d[key] = value
    if pod.running:
        d["running"] = True
    return d


def load_workload(path: str | Path) -> Workload:
    """Read a workload file (YAML or JSON; see the module docstring)."""
    p = Path(path)
    doc = read_document(p, WorkloadError, "workload")
    if isinstance(doc, dict) and "synthetic" in doc:
        name = doc.get("name") or p.stem
        if not isinstance(name, str) or set(doc) - {"name", "synthetic"}:
            raise WorkloadError(
                f"{p}: a synthetic workload has only 'name' (a string) and 'synthetic'"
            )
        spec = synthetic_spec_from_doc(doc["synthetic"], f"{p}: synthetic")
        try:
            workload = synthetic_workload(spec, name=name)
        except WorkloadError as e:
            raise WorkloadError(f"{p}: {e}") from None
        return replace(workload, source=f"{p}, {workload.source}")
    return parse_workload(doc, str(p), default_name=p.stem)


# --------------------------------------------------------------------------- generator


@dataclass(frozen=True, slots=True)
class PodShape:
    """One entry of a synthetic size mix."""

    weight: float
    cpu_milli: int
    memory_mib: int = 0
    num_gpu: int = 0
    gpu_milli: int = 0
    qos: str = "LS"


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    """Parameters of the seeded synthetic workload generator."""

    count: int
    """Number of pods to generate."""
    mix: tuple[PodShape, ...]
    """Weighted size mix; weights need not sum to 1."""
    arrival_rate_per_s: float = 1.0
    """Poisson arrival rate (pods per second)."""
    mean_duration_s: float = 3600.0
    """Mean of the exponential run time (seconds; at least 1 s)."""
    seed: int = 0
    name_prefix: str = "syn"
    jitter_cpu: float = 0.0
    """Relative uniform jitter applied to CPU requests (0 = exact shapes)."""

    def __post_init__(self) -> None:
        if self.count < 1:
            raise WorkloadError(f"synthetic spec: count must be >= 1, got {self.count}")
        if (
            not self.mix
            or any(s.weight < 0 for s in self.mix)
            or sum(s.weight for s in self.mix) <= 0
        ):
            raise WorkloadError("synthetic spec: 'mix' needs at least one shape with weight > 0")
        if self.arrival_rate_per_s <= 0 or self.mean_duration_s <= 0:
            raise WorkloadError(
                "synthetic spec: arrival_rate_per_s and mean_duration_s must be > 0"
            )


def synthetic_workload(spec: SyntheticSpec, name: str = "synthetic") -> Workload:
    """Draw ``spec.count`` pods (seeded; same spec and seed -> same workload)."""
    rng = random.Random(spec.seed)
    weights = [s.weight for s in spec.mix]
    t = 0.0
    pods: list[Pod] = []
    for i in range(spec.count):
        t += rng.expovariate(spec.arrival_rate_per_s)
        shape = rng.choices(spec.mix, weights=weights)[0]
        duration = max(1, round(rng.expovariate(1.0 / spec.mean_duration_s)))
        cpu = shape.cpu_milli
        if spec.jitter_cpu > 0:
            cpu = max(0, round(cpu * (1 + rng.uniform(-spec.jitter_cpu, spec.jitter_cpu))))
        num_gpu, gm = normalise_gpu_milli(shape.num_gpu, shape.gpu_milli)
        start = round(t)
        if start + duration > MAX_TIME_S:
            raise WorkloadError(
                f"synthetic spec: pod {i} would end at {start + duration:,} s, past the time "
                f"limit {MAX_TIME_S:,} s; raise arrival_rate_per_s or lower count or "
                "mean_duration_s"
            )
        pods.append(
            Pod(
                name=f"{spec.name_prefix}-{i:05d}",
                cpu_milli=cpu,
                memory_mib=shape.memory_mib,
                num_gpu=num_gpu,
                gpu_milli=gm,
                qos=shape.qos,
                creation_time=start,
                deletion_time=start + duration,
            )
        )
    return Workload(name=name, pods=tuple(pods), source=f"synthetic(seed={spec.seed})")


_SHAPE_FIELDS = frozenset({"weight", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "qos"})
_SYNTHETIC_FIELDS = frozenset(
    {"count", "seed", "arrival_rate_per_s", "mean_duration_s", "mix", "name_prefix", "jitter_cpu"}
)
MAX_MIX = 1000
"""Shapes in one synthetic mix."""


def _number(
    d: Mapping[str, Any], key: str, where: str, default: float, lo: float, hi: float
) -> float:
    """``d[key]`` as a finite number in ``[lo, hi]`` (``default`` when absent)."""
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise WorkloadError(f"{where}: field {key!r} must be a number, got {v!r:.60}")
    if not lo <= v <= hi:
        raise WorkloadError(f"{where}: field {key!r} is {v:g}; it must be in {lo:g}..{hi:g}")
    return float(v)


def _integer(d: Mapping[str, Any], key: str, where: str, default: int, lo: int, hi: int) -> int:
    """``d[key]`` as an integer in ``[lo, hi]`` (``default`` when absent)."""
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise WorkloadError(f"{where}: field {key!r} must be an integer, got {v!r:.60}")
    if not lo <= v <= hi:
        raise WorkloadError(f"{where}: field {key!r} is {v:,}; it must be in {lo:,}..{hi:,}")
    return v


def _known_fields(d: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    unknown = set(d) - allowed
    if unknown:
        raise WorkloadError(
            f"{where}: unknown field(s) {sorted(map(str, unknown))}; allowed: {sorted(allowed)}"
        )


def synthetic_spec_from_doc(doc: object, where: str) -> SyntheticSpec:
    """Parse a ``synthetic:`` block: count, seed, arrival_rate_per_s, mean_duration_s, mix."""
    if not isinstance(doc, dict):
        raise WorkloadError(f"{where}: expected a mapping")
    _known_fields(doc, _SYNTHETIC_FIELDS, where)
    mix_doc = doc.get("mix")
    if not isinstance(mix_doc, list) or not mix_doc:
        raise WorkloadError(f"{where}: 'mix' must be a non-empty list of shapes with a 'weight'")
    if len(mix_doc) > MAX_MIX:
        raise WorkloadError(f"{where}: 'mix' has {len(mix_doc):,} shapes; the limit is {MAX_MIX}")
    mix: list[PodShape] = []
    for i, m in enumerate(mix_doc):
        w = f"{where}: mix[{i}]"
        if not isinstance(m, dict) or "weight" not in m or "cpu_milli" not in m:
            raise WorkloadError(f"{w}: each shape needs 'weight' and 'cpu_milli'")
        _known_fields(m, _SHAPE_FIELDS, w)
        qos = m.get("qos", "LS")
        if not isinstance(qos, str):
            raise WorkloadError(f"{w}: field 'qos' must be a string, got {qos!r:.60}")
        mix.append(
            PodShape(
                weight=_number(m, "weight", w, 0.0, 0.0, 1e12),
                cpu_milli=_integer(m, "cpu_milli", w, 0, 0, MAX_CPU_MILLI),
                memory_mib=_integer(m, "memory_mib", w, 0, 0, MAX_MEMORY_MIB),
                num_gpu=_integer(m, "num_gpu", w, 0, 0, MAX_GPUS_PER_NODE),
                gpu_milli=_integer(m, "gpu_milli", w, 0, 0, GPU_MILLI),
                qos=qos,
            )
        )
    prefix = doc.get("name_prefix", "syn")
    if not isinstance(prefix, str) or not prefix or len(prefix) > 63:
        raise WorkloadError(f"{where}: 'name_prefix' must be a string of 1 to 63 characters")
    count = _integer(doc, "count", where, 1000, 1, MAX_PODS)
    rate = _number(doc, "arrival_rate_per_s", where, 1.0, 1e-9, 1e6)
    mean = _number(doc, "mean_duration_s", where, 3600.0, 1.0, MAX_TIME_S)
    seed = _integer(doc, "seed", where, 0, -(2**63), 2**63 - 1)
    jitter = _number(doc, "jitter_cpu", where, 0.0, 0.0, 1.0)
    try:
        return SyntheticSpec(count, tuple(mix), rate, mean, seed, prefix, jitter)
    except WorkloadError as e:  # SyntheticSpec's own checks name no file
        raise WorkloadError(f"{where}: {str(e).removeprefix('synthetic spec: ')}") from None
