"""Pods observed in kube-state-metrics series (``gpuslice export`` from Prometheus data).

Inputs
------
Files of one of two shapes (told apart by their first character):

* the JSON answer of Prometheus' HTTP API, ``/api/v1/query_range`` (``resultType: matrix``) or
  ``/api/v1/query`` (``vector``), or its ``data`` object, or a JSON array of such answers;
  series must keep their ``__name__`` (query the bare metrics, no aggregation);
* the text exposition format of a scrape of kube-state-metrics' ``/metrics`` (Prometheus text,
  sample timestamps in milliseconds, or OpenMetrics with ``# EOF``, in seconds).  A sample
  without a timestamp was taken at the file's time: ``FILE@2026-11-23T10:00:00Z``, a UTC stamp
  in the file name (``metrics-20261123T100000Z.txt``), else the latest time value in the file
  (a lower bound).

Metrics read (every other series is ignored), per pod (``namespace``, ``pod``, ``uid`` labels;
``uid`` is absent before kube-state-metrics v2, then ``namespace/pod`` identifies the pod):

=========================================  ===================================================
``kube_pod_container_resource_requests``   requests per container and ``resource`` (summed);
                                           the ``resource`` label is sanitised
                                           (``nvidia_com_mig_1g_10gb``) and mapped back
                                           (:func:`simulations.inputs.gpu_resources.from_ksm_label`);
                                           ``unit`` ``core`` (CPU) and ``byte`` (memory)
``kube_pod_init_container_resource_requests``  init containers (their maximum counts)
``kube_pod_created``                       arrival (else: first sample, counted)
``kube_pod_status_scheduled_time``         scheduled (else ``kube_pod_start_time``)
``kube_pod_completion_time``               end: finished -- only if ``kube_pod_status_phase``
                                           last said Succeeded or Failed, where that series is
                                           there (kube-state-metrics sets the completion time
                                           once *any* container has terminated, a crash-looping
                                           one in a running pod too)
``kube_pod_status_phase``                  the phase (the series whose value is 1)
``kube_pod_deletion_timestamp``            end: deleted (``kube_pod_deleted`` before v2)
``kube_pod_info``                          ``priority_class`` label (see below)
``kube_pod_status_qos_class``              QoS class (the series whose value is 1)
=========================================  ===================================================

A pod whose series stop before the last sample of all files *vanished* at its last sample;
one still sampled at the end is *running*.  kube-state-metrics exports no numeric priority:
``--priority-class NAME=VALUE`` gives one to the pods of a PriorityClass (others: 0; the
classes of GPU pods left at 0 are reported).

A query that fetches all of it at once (one step per minute over a day)::

    curl -sG http://prometheus:9090/api/v1/query_range \\
      --data-urlencode 'query={__name__=~"kube_pod_container_resource_requests|kube_pod_init_container_resource_requests|kube_pod_created|kube_pod_status_scheduled_time|kube_pod_start_time|kube_pod_completion_time|kube_pod_deletion_timestamp|kube_pod_info|kube_pod_status_qos_class|kube_pod_status_phase"}' \\
      --data-urlencode start=2026-11-22T10:00:00Z --data-urlencode end=2026-11-23T10:00:00Z \\
      --data-urlencode step=60 > ksm.json
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from contract.input_files import MAX_SNAPSHOT_BYTES, InputError, parse_json, read_text
from simulations.export.pods import (
    ExportError,
    ExportReport,
    ObservedPod,
    build_workload,
    split_at,
    time_error,
)
from simulations.inputs.gpu_resources import from_ksm_label, is_gpu_resource
from simulations.inputs.workload import Workload, clip

__all__ = ["Sample", "export_ksm", "observe_samples", "parse_priority_classes", "read_samples"]

REQUESTS = "kube_pod_container_resource_requests"
INIT_REQUESTS = "kube_pod_init_container_resource_requests"
CREATED = "kube_pod_created"
SCHEDULED = "kube_pod_status_scheduled_time"
STARTED = "kube_pod_start_time"
COMPLETED = "kube_pod_completion_time"
DELETED = ("kube_pod_deletion_timestamp", "kube_pod_deleted")
INFO = "kube_pod_info"
QOS = "kube_pod_status_qos_class"
PHASE = "kube_pod_status_phase"
_FINISHED = ("Succeeded", "Failed")
_TIME_METRICS = (CREATED, SCHEDULED, STARTED, COMPLETED, *DELETED)
_FIX = (
    "export the series with their names, e.g. a query_range of "
    '{__name__=~"kube_pod_container_resource_requests|kube_pod_created|..."} (docs/workloads.md)'
)
_LINE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+(?P<ts>\S+))?\s*$"
)
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    time: float
    value: float


# --------------------------------------------------------------------------- JSON (Prometheus API)


def _api_results(doc: Any, where: str) -> Iterator[tuple[Mapping[str, Any], str]]:
    """(result entry, where) of a Prometheus API answer (module docstring)."""
    if isinstance(doc, list):
        for k, d in enumerate(doc):
            yield from _api_results(d, f"{where}[{k}]")
        return
    if not isinstance(doc, dict):
        raise ExportError(f"{where}: expected a Prometheus API answer (an object); {_FIX}")
    if doc.get("status") == "error":
        raise ExportError(
            f"{where}: the query failed: {doc.get('errorType', '')} {doc.get('error', '')}".strip()
        )
    data = doc.get("data", doc)
    if not isinstance(data, dict) or "result" not in data:
        raise ExportError(
            f"{where}: not a Prometheus /api/v1/query_range answer (no data.result); {_FIX}"
        )
    kind = data.get("resultType", "matrix")
    if kind not in ("matrix", "vector"):
        raise ExportError(f"{where}: resultType {kind!r}: a matrix or vector of series is needed")
    result = data["result"]
    if not isinstance(result, list):
        raise ExportError(f"{where}: data.result must be a list")
    for k, entry in enumerate(result):
        if not isinstance(entry, dict) or not isinstance(entry.get("metric"), dict):
            raise ExportError(f"{where}: data.result[{k}] has no 'metric' object")
        yield entry, f"{where}: data.result[{k}]"


def _value(raw: Any, where: str) -> tuple[float, float]:
    if not isinstance(raw, list) or len(raw) != 2:
        raise ExportError(f'{where}: a sample must be [time, "value"], got {raw!r:.60}')
    t, v = raw
    try:
        ft, fv = float(t), float(v)
    except (TypeError, ValueError):
        raise ExportError(f"{where}: unreadable sample {raw!r:.60}") from None
    if not math.isfinite(ft):
        raise ExportError(f"{where}: sample time {t!r} is not a number")
    return ft, fv


def _json_samples(doc: Any, where: str) -> Iterator[Sample]:
    for entry, at in _api_results(doc, where):
        labels = {str(k): str(v) for k, v in entry["metric"].items()}
        name = labels.pop("__name__", "")
        if not name:
            raise ExportError(
                f"{at}: a series without __name__ ({labels}): the query aggregated or renamed "
                f"the metrics; {_FIX}"
            )
        raws = entry.get("values") if "values" in entry else [entry.get("value")]
        if not isinstance(raws, list):
            raise ExportError(f"{at}: 'values' must be a list of [time, \"value\"]")
        for raw in raws:
            t, v = _value(raw, at)
            yield Sample(name, labels, t, v)


# --------------------------------------------------------------------------- text exposition


def _labels(text: str, where: str) -> dict[str, str]:
    out: dict[str, str] = {}
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _LABEL.match(text, pos)
        if m is None:
            raise ExportError(f"{where}: malformed labels {{{text[:80]}}}")
        out[m.group(1)] = re.sub(r'\\[\\"n]', lambda e: _UNESCAPE[e.group(0)], m.group(2))
        pos = m.end()
    return out


def _text_samples(text: str, where: str, at: float | None) -> list[Sample]:
    """Samples of an exposition-format file; untimed ones get ``at`` (or the inferred time)."""
    openmetrics = any(line.strip() == "# EOF" for line in text.splitlines()[-3:])
    timed: list[Sample] = []
    untimed: list[tuple[str, dict[str, str], float]] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            raise ExportError(f"{where}:{n}: not a sample line of the Prometheus text format")
        labels = _labels(m.group("labels") or "", f"{where}:{n}")
        try:
            value = float(m.group("value"))
            ts = m.group("ts")
            t = None if ts is None else float(ts) / (1.0 if openmetrics else 1000.0)
        except ValueError:
            raise ExportError(f"{where}:{n}: unreadable value or timestamp") from None
        if t is None:
            untimed.append((m.group("name"), labels, value))
        else:
            timed.append(Sample(m.group("name"), labels, t, value))
    if untimed and at is None:
        stamps = [v for name, _, v in untimed if name in _TIME_METRICS and not time_error(v, "")]
        stamps += [s.time for s in timed if not time_error(s.time, "")]
        if not stamps:
            raise ExportError(
                f"{where}: its samples carry no time and it holds no kube_pod_created value, so "
                f"when it was scraped is unknown; name the time: {where}@2026-11-23T10:00:00Z"
            )
        at = max(stamps)
    return timed + [Sample(name, labels, at or 0.0, v) for name, labels, v in untimed]


def read_samples(spec: str) -> tuple[str, list[Sample]]:
    """(path, samples) of one ``FILE[@TIME]`` (module docstring)."""
    path, at = split_at(spec)
    try:
        text = read_text(path, "kube-state-metrics", MAX_SNAPSHOT_BYTES)
        if text.lstrip()[:1] in ("{", "["):
            return path, list(_json_samples(parse_json(text, path, check_depth=False), path))
    except InputError as e:
        raise ExportError(str(e)) from None
    return path, _text_samples(text, path, at)


# --------------------------------------------------------------------------- pods


def parse_priority_classes(entries: Sequence[str]) -> dict[str, int]:
    """``NAME=VALUE`` entries (``--priority-class``) -> {NAME: VALUE}."""
    out: dict[str, int] = {}
    for entry in entries:
        name, sep, value = entry.partition("=")
        try:
            number = int(value)
        except ValueError:
            number = None
        if not sep or not name.strip() or number is None or abs(number) > 2**31 - 1:
            raise ExportError(
                f"--priority-class {entry!r}: expected NAME=VALUE with an int32 VALUE, e.g. "
                "high-priority=1000 (kubectl get priorityclasses shows them)"
            )
        out[name.strip()] = number
    return out


@dataclass(slots=True)
class _Acc:
    """Everything one pod's series say, before it becomes an :class:`ObservedPod`."""

    pod: ObservedPod
    containers: dict[tuple[str, str], tuple[float, float]]
    init: dict[tuple[str, str], tuple[float, float]]
    priority_class: str = ""
    qos: tuple[float, str] = (-math.inf, "")
    phase: tuple[float, str] = (-math.inf, "")


def _latest(store: dict[Any, tuple[float, float]], key: Any, s: Sample) -> None:
    if key not in store or store[key][0] <= s.time:
        store[key] = (s.time, s.value)


def observe_samples(
    files: Sequence[tuple[str, list[Sample]]],
    report: ExportReport,
    priority_classes: Mapping[str, int] | None = None,
) -> tuple[list[ObservedPod], float]:
    """Every pod the samples show, and the end of the observation (the last sample)."""
    classes = priority_classes or {}
    accs: dict[tuple[str, str, str], _Acc] = {}
    end = -math.inf
    for path, samples in files:
        for s in samples:
            problem = time_error(s.time, f"the sample time of {clip(s.name)}")
            if problem:
                labels = ", ".join(f"{k}={clip(v)!r}" for k, v in list(s.labels.items())[:4])
                raise ExportError(f"{path}: {problem} ({labels})")
            end = max(end, s.time)
            ns, name = s.labels.get("namespace"), s.labels.get("pod")
            if not s.name.startswith("kube_pod_") or not ns or not name:
                continue
            key = (ns, name, s.labels.get("uid", ""))
            acc = accs.get(key)
            if acc is None:
                where = f"{path} ({clip(f'{ns}/{name}')})"
                acc = _Acc(ObservedPod(ns, name, key[2], where, s.time, s.time), {}, {})
                accs[key] = acc
            p = acc.pod
            p.first_seen, p.last_seen = min(p.first_seen, s.time), max(p.last_seen, s.time)
            if not math.isfinite(s.value):
                continue
            problem = time_error(s.value, s.name) if s.name in _TIME_METRICS else ""
            if problem:
                raise ExportError(f"{acc.pod.where}: {problem}")
            if s.name in (REQUESTS, INIT_REQUESTS):
                resource = s.labels.get("resource", "")
                store = acc.containers if s.name == REQUESTS else acc.init
                _latest(store, (s.labels.get("container", ""), resource), s)
            elif s.name == CREATED:
                p.created = s.value
            elif s.name == SCHEDULED or (s.name == STARTED and p.scheduled is None):
                p.scheduled = s.value  # the scheduled time wins over the start time
            elif s.name == COMPLETED:
                p.finished = s.value
            elif s.name in DELETED:
                p.deleted = s.value
            elif s.name == INFO:
                acc.priority_class = s.labels.get("priority_class", "")
            elif s.name == QOS and s.value == 1 and s.time >= acc.qos[0]:
                acc.qos = (s.time, s.labels.get("qos_class", ""))
            elif s.name == PHASE and s.value == 1 and s.time >= acc.phase[0]:
                acc.phase = (s.time, s.labels.get("phase", ""))
    if not accs:
        raise ExportError(
            f"no kube_pod_* series with namespace and pod labels in {', '.join(report.files)}; "
            + _FIX
        )
    unknown: dict[str, int] = {}
    for acc in accs.values():
        _finish(acc)
        if acc.priority_class and any(map(is_gpu_resource, acc.pod.requests)):
            if acc.priority_class in classes:
                acc.pod.priority = classes[acc.priority_class]
            else:
                unknown[acc.priority_class] = unknown.get(acc.priority_class, 0) + 1
    if unknown:
        listed = ", ".join(f"{c} ({n} pods)" for c, n in sorted(unknown.items()))
        report.notes.append(
            f"kube-state-metrics has no numeric priority; pods of priority classes {listed} get "
            "priority 0: pass --priority-class NAME=VALUE to set them"
        )
    return [a.pod for a in accs.values()], end


def _finish(acc: _Acc) -> None:
    """Requests summed over containers (init containers' maximum), units converted."""
    total: dict[str, float] = {}
    for (_, resource), (_, value) in acc.containers.items():
        total[resource] = total.get(resource, 0.0) + value
    for (_, resource), (_, value) in acc.init.items():
        total[resource] = max(total.get(resource, 0.0), value)
    p = acc.pod
    for label, value in total.items():
        if label == "cpu":
            p.cpu_milli = math.ceil(value * 1000 - 1e-9)
        elif label == "memory":
            p.memory_mib = math.ceil(value / (1024 * 1024) - 1e-9)
        else:
            resource = from_ksm_label(label)
            p.requests[resource] = Decimal(repr(value))
            if resource != label:
                p.source_names[resource] = label
    p.qos = acc.qos[1]
    if acc.phase[1] and acc.phase[1] not in _FINISHED:
        p.finished = None  # a container ended, the pod did not (module docstring)


def export_ksm(
    specs: Sequence[str],
    name: str | None = None,
    resource_map: Mapping[str, str | None] | None = None,
    priority_classes: Mapping[str, int] | None = None,
) -> tuple[Workload, ExportReport]:
    """A workload from kube-state-metrics series files ``FILE[@TIME]`` (module docstring)."""
    if not specs:
        raise ExportError(f"no kube-state-metrics file given; {_FIX}")
    files = [read_samples(s) for s in specs]
    report = ExportReport(source="kube-state-metrics", files=[p for p, _ in files])
    observed, end = observe_samples(files, report, priority_classes)
    workload = build_workload(observed, end, report, name or Path(files[0][0]).stem, resource_map)
    return workload, report
