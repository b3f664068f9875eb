"""Pods and workloads for the simulator: the types, our YAML/JSON workload format, a seeded generator.

Model
-----
A :class:`Pod` is one request as the openb traces describe it: CPU (milli-cores), host memory
(MiB), ``num_gpu`` GPUs each shared at ``gpu_milli`` thousandths (1000 = the whole GPU), an
optional set of GPU models it may run on (``gpu_spec``; empty = any model), a QoS class and
optional times in seconds (creation, deletion, scheduled; the saturation protocol ignores them,
the time-replay protocol uses them).  Invariants, enforced at construction:

* ``num_gpu == 0`` (CPU-only) implies ``gpu_milli == 0``;
* ``num_gpu >= 1`` implies ``1 <= gpu_milli <= 1000``;  a *sharing* pod has ``num_gpu == 1`` and
  ``gpu_milli < 1000``; everything else with GPUs takes whole GPUs.

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
        deletion_time: 3600      # optional, seconds, > creation_time
        replicas: 3              # optional: expands to train-0-0, train-0-1, train-0-2

Every error names the file, the pod's position (``pods[3]``) and the field to fix.

Synthetic generator
-------------------
:func:`synthetic_workload` draws ``count`` pods from a :class:`SyntheticSpec`: Poisson arrivals
at ``arrival_rate_per_s``, a weighted size mix of :class:`PodShape` entries, and exponential
durations with mean ``mean_duration_s`` (minimum 1 s).  It uses only ``random.Random(seed)``,
so the same spec and seed give the same workload on every machine.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from simulations.documents import named_entry, read_document

__all__ = [
    "Pod",
    "PodShape",
    "SyntheticSpec",
    "Workload",
    "WorkloadError",
    "load_workload",
    "normalise_gpu_milli",
    "parse_workload",
    "synthetic_spec_from_doc",
    "synthetic_workload",
]

GPU_MILLI = 1000
"""Milli-units of one whole GPU."""


class WorkloadError(ValueError):
    """A workload file or trace is invalid; the message names the file, line or entry."""


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

    def __post_init__(self) -> None:
        if self.cpu_milli < 0 or self.memory_mib < 0 or self.num_gpu < 0:
            raise WorkloadError(
                f"pod {self.name!r}: cpu_milli, memory_mib and num_gpu must be >= 0 "
                f"(got {self.cpu_milli}, {self.memory_mib}, {self.num_gpu})"
            )
        if self.num_gpu == 0 and self.gpu_milli != 0:
            raise WorkloadError(f"pod {self.name!r}: a CPU-only pod (num_gpu 0) has gpu_milli 0")
        if self.num_gpu > 0 and not 1 <= self.gpu_milli <= GPU_MILLI:
            raise WorkloadError(
                f"pod {self.name!r}: gpu_milli must be 1..1000 per GPU, got {self.gpu_milli}"
            )
        if (
            self.creation_time is not None
            and self.deletion_time is not None
            and self.deletion_time < self.creation_time
        ):
            raise WorkloadError(
                f"pod {self.name!r}: deletion_time {self.deletion_time} is before "
                f"creation_time {self.creation_time}"
            )

    @property
    def total_gpu_milli(self) -> int:
        """The pod's whole GPU request in milli-GPUs (``num_gpu * gpu_milli``)."""
        return self.num_gpu * self.gpu_milli

    @property
    def is_cpu_only(self) -> bool:
        return self.num_gpu == 0

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
    """Where it came from (file path or ``synthetic(seed=...)``)."""

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for p in self.pods:
            if p.name in seen:
                raise WorkloadError(f"workload {self.name!r}: duplicate pod name {p.name!r}")
            seen.add(p.name)

    @property
    def total_gpu_milli(self) -> int:
        return sum(p.total_gpu_milli for p in self.pods)

    def __len__(self) -> int:
        return len(self.pods)


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
    "replicas",
}


def _int_field(d: Mapping[str, Any], key: str, where: str, default: int | None) -> int | None:
    """``d[key]`` as an int; ``default`` when absent or null."""
    if key not in d or d[key] is None:
        return default
    v = d[key]
    if (
        isinstance(v, bool)
        or not isinstance(v, int | float)
        or (isinstance(v, float) and not v.is_integer())
    ):
        raise WorkloadError(f"{where}: field {key!r} must be an integer, got {v!r}")
    return int(v)


def _parse_pod_entry(entry: object, where: str) -> list[Pod]:
    d, name, where = named_entry(
        entry, _POD_FIELDS, where, WorkloadError, "with at least 'name' and 'cpu_milli'"
    )
    if "cpu_milli" not in d:
        raise WorkloadError(f"{where}: missing required field 'cpu_milli'")
    cpu = _int_field(d, "cpu_milli", where, 0)
    mem = _int_field(d, "memory_mib", where, 0)
    num_gpu = _int_field(d, "num_gpu", where, 0)
    gpu_milli = _int_field(d, "gpu_milli", where, 0)
    replicas = _int_field(d, "replicas", where, 1)
    assert cpu is not None and mem is not None and num_gpu is not None
    assert gpu_milli is not None and replicas is not None
    if num_gpu > 0 and "gpu_milli" not in d:
        raise WorkloadError(f"{where}: num_gpu is {num_gpu}, so 'gpu_milli' (1..1000) is required")
    if replicas < 1:
        raise WorkloadError(f"{where}: replicas must be >= 1, got {replicas}")
    try:
        spec = parse_gpu_spec(d.get("gpu_spec"))
        base = dict(
            cpu_milli=cpu,
            memory_mib=mem,
            num_gpu=num_gpu,
            gpu_milli=gpu_milli if num_gpu > 0 else 0,
            gpu_spec=spec,
            qos=str(d.get("qos") or ""),
            creation_time=_int_field(d, "creation_time", where, None),
            deletion_time=_int_field(d, "deletion_time", where, None),
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
            f"{where}: expected a mapping with a 'pods' list (see simulations.workload)"
        )
    entries = doc["pods"]
    if not isinstance(entries, list) or not entries:
        raise WorkloadError(f"{where}: 'pods' must be a non-empty list")
    pods: list[Pod] = []
    for i, entry in enumerate(entries):
        pods.extend(_parse_pod_entry(entry, f"{where}: pods[{i}]"))
    name = str(doc.get("name") or default_name)
    try:
        return Workload(name=name, pods=tuple(pods), source=where)
    except WorkloadError as e:
        raise WorkloadError(f"{where}: {e}") from None


def load_workload(path: str | Path) -> Workload:
    """Read a workload file (YAML or JSON; see the module docstring)."""
    p = Path(path)
    doc = read_document(p, WorkloadError, "workload")
    if isinstance(doc, dict) and "synthetic" in doc:
        spec = synthetic_spec_from_doc(doc["synthetic"], f"{p}: synthetic")
        return synthetic_workload(spec, name=str(doc.get("name") or p.stem))
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


def synthetic_spec_from_doc(doc: object, where: str) -> SyntheticSpec:
    """Parse a ``synthetic:`` block: count, seed, arrival_rate_per_s, mean_duration_s, mix."""
    if not isinstance(doc, dict):
        raise WorkloadError(f"{where}: expected a mapping")
    mix_doc = doc.get("mix")
    if not isinstance(mix_doc, list) or not mix_doc:
        raise WorkloadError(f"{where}: 'mix' must be a non-empty list of shapes with a 'weight'")
    mix: list[PodShape] = []
    for i, m in enumerate(mix_doc):
        w = f"{where}: mix[{i}]"
        if not isinstance(m, dict) or "weight" not in m or "cpu_milli" not in m:
            raise WorkloadError(f"{w}: each shape needs 'weight' and 'cpu_milli'")
        try:
            mix.append(
                PodShape(
                    weight=float(m["weight"]),
                    cpu_milli=int(m["cpu_milli"]),
                    memory_mib=int(m.get("memory_mib", 0)),
                    num_gpu=int(m.get("num_gpu", 0)),
                    gpu_milli=int(m.get("gpu_milli", 0)),
                    qos=str(m.get("qos", "LS")),
                )
            )
        except (TypeError, ValueError) as e:
            raise WorkloadError(f"{w}: {e}") from None
    try:
        return SyntheticSpec(
            count=int(doc.get("count", 1000)),
            mix=tuple(mix),
            arrival_rate_per_s=float(doc.get("arrival_rate_per_s", 1.0)),
            mean_duration_s=float(doc.get("mean_duration_s", 3600.0)),
            seed=int(doc.get("seed", 0)),
            name_prefix=str(doc.get("name_prefix", "syn")),
            jitter_cpu=float(doc.get("jitter_cpu", 0.0)),
        )
    except (TypeError, ValueError) as e:
        raise WorkloadError(f"{where}: {e}") from None
