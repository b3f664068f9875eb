"""Pods observed in kubectl dumps taken over time (``gpuslice export`` from kubectl output).

Inputs
------
One or more files, each one observation of the cluster's pods:

* ``kubectl get pods -A -o json`` (or ``-o yaml``): a ``List``/``PodList`` whose items are Pods;
  ``kubectl get nodes,pods -A -o json`` too (the Nodes are read for GFD's MIG strategy, other
  objects are counted and skipped);
* one Pod object (``kubectl get pod NAME -o json``) or a JSON array of objects;
* a watch stream, ``kubectl get pods -A -o json --watch [--output-watch-events]``: concatenated
  JSON objects (or YAML documents separated by ``---``), each a Pod or a ``{type, object}``
  watch event; a ``DELETED`` event ends its pod.

Each file is one observation taken at a time: ``FILE@2026-11-23T10:00:00Z`` (or ``FILE@<epoch
seconds>``) says when, else a UTC stamp in the file name (``pods-20261123T100000Z.json``, as
``date -u +%Y%m%dT%H%M%SZ`` writes it); without either, the latest timestamp inside the file
stands for it (a creation, start, transition or finish time: a lower bound, since kubectl
writes no time of its own).  Observations are ordered by that time.  A pod (by uid) present in one observation and
absent from every later one *vanished* at the last time it was seen.  Within one file (a watch
stream) later objects replace earlier states of the same pod.

From each pod: ``metadata.creationTimestamp`` (required: manifests without it are refused),
``uid``, ``deletionTimestamp``; ``spec.priority`` and the effective requests
(:func:`partitioner.quantities.pod_requests`: containers summed, init containers' maximum,
limits where requests are absent, overhead); ``status.phase``, ``qosClass``, ``startTime``,
the PodScheduled condition and the containers' ``state.terminated.finishedAt``.

GFD's ``single`` MIG strategy serves MIG devices as ``nvidia.com/gpu``: a pod bound to a Node of
the dump labelled ``nvidia.com/mig.strategy=single`` with ``nvidia.com/gpu.product=
<model>-MIG-<profile>`` (``-SHARED`` appended when the GPUs are shared) is read as asking for
``nvidia.com/mig-<profile>`` (reported).
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from contract.input_files import MAX_SNAPSHOT_BYTES, InputError, parse_json, parse_yaml, read_text
from partitioner.quantities import QuantityError, cpu_milli, memory_mib, pod_requests
from planner.snapshot import mig_resource
from simulations.export.pods import (
    END_FINISHED,
    ExportError,
    ExportReport,
    ObservedPod,
    build_workload,
    parse_time,
    split_at,
)
from simulations.inputs.gpu_resources import WHOLE_GPU
from simulations.inputs.workload import Workload, clip

__all__ = ["Dump", "export_kubectl", "observe_dumps", "read_dump"]

_FIX = "dump the pods with: kubectl get pods -A -o json > pods-$(date -u +%Y%m%dT%H%M%SZ).json"
_FINISHED = ("Succeeded", "Failed")
_YAML_SPLIT = re.compile(r"(?m)^---[ \t]*(?:#.*)?$")
STRATEGY_LABEL = "nvidia.com/mig.strategy"
PRODUCT_LABEL = "nvidia.com/gpu.product"

Obj = Mapping[str, Any]


@dataclass(slots=True)
class Dump:
    """One file: its pods (in file order, with watch-event types) and what else it held."""

    path: str
    time: float | None
    """When it was taken (``FILE@TIME``), else ``None`` until inferred."""
    pods: list[tuple[Obj, str, int]] = field(default_factory=list)
    """(pod, watch event type or ``""``, position in the file)."""
    single_profile: dict[str, str] = field(default_factory=dict)
    """node -> MIG profile it serves as ``nvidia.com/gpu`` (GFD single strategy)."""
    other_objects: int = 0
    inferred: bool = False


# --------------------------------------------------------------------------- reading


def _documents(text: str, where: str) -> list[Any]:
    """Every top-level document of ``text``: JSON (one value or concatenated) or YAML (``---``)."""
    if text.lstrip()[:1] in ("{", "["):
        try:
            return [parse_json(text, where, check_depth=False)]
        except InputError as e:
            if "Extra data" not in str(e):
                raise
        decoder = json.JSONDecoder()
        bounds: list[tuple[int, int]] = []
        i, n = 0, len(text)
        while True:
            while i < n and text[i].isspace():
                i += 1
            if i >= n:
                break
            try:
                _, end = decoder.raw_decode(text, i)
            except json.JSONDecodeError as e:
                raise InputError(
                    f"{where}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
                ) from None
            bounds.append((i, end))
            i = end
        return [
            parse_json(text[a:b], f"{where} (object {k + 1})", check_depth=False)
            for k, (a, b) in enumerate(bounds)
        ]
    parts = [p for p in _YAML_SPLIT.split(text) if p.strip()]
    return [
        parse_yaml(p, where if len(parts) == 1 else f"{where} (document {k + 1})")
        for k, p in enumerate(parts)
    ]


def _objects(doc: Any, where: str) -> Iterator[tuple[Obj, str]]:
    """(object, watch event type) pairs of one document."""
    if doc is None:
        return
    if isinstance(doc, list):
        for item in doc:
            yield from _objects(item, where)
        return
    if not isinstance(doc, dict):
        raise ExportError(
            f"{where}: expected kubectl's JSON or YAML objects, got {type(doc).__name__}; {_FIX}"
        )
    if "object" in doc and "type" in doc and isinstance(doc["object"], dict):
        yield doc["object"], str(doc["type"]).upper()
        return
    if isinstance(doc.get("items"), list):
        for item in doc["items"]:
            if not isinstance(item, dict):
                raise ExportError(f"{where}: an item of the list is not an object; {_FIX}")
            yield item, ""
        return
    if "kind" in doc or "metadata" in doc:
        yield doc, ""
        return
    raise ExportError(
        f"{where}: not a kubectl List, Pod or watch event (keys: {', '.join(sorted(map(str, doc))[:8])}); {_FIX}"
    )


def _mapping(value: Any) -> Obj:
    """``value`` if it is an object, else an empty one (a malformed field reads as absent)."""
    return value if isinstance(value, dict) else {}


def _object_list(value: Any) -> list[Obj]:
    """The objects of a list field; anything else reads as absent."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _single_profile(node: Obj) -> tuple[str, str] | None:
    meta = _mapping(node.get("metadata"))
    labels = meta.get("labels") or {}
    if not isinstance(labels, dict) or labels.get(STRATEGY_LABEL) != "single":
        return None
    product = str(labels.get(PRODUCT_LABEL, ""))
    _, sep, profile = product.partition("-MIG-")
    profile = profile.removesuffix("-SHARED")  # GFD's mark of shared GPUs (time-slicing, MPS)
    if not sep or not profile or profile.upper() == "INVALID":
        return None
    return str(meta.get("name", "")), profile.lower()


def read_dump(spec: str) -> Dump:
    """Read one ``FILE[@TIME]`` (module docstring)."""
    path, at = split_at(spec)
    try:
        text = read_text(path, "kubectl dump", MAX_SNAPSHOT_BYTES)
        docs = _documents(text, path)
    except InputError as e:
        raise ExportError(str(e)) from None
    dump = Dump(path=path, time=at)
    position = 0
    for doc in docs:
        for obj, event in _objects(doc, path):
            kind = obj.get("kind")
            if kind == "Pod" or (
                kind is None and isinstance(_mapping(obj.get("spec")).get("containers"), list)
            ):
                dump.pods.append((obj, event, position))
            elif kind == "Node":
                single = _single_profile(obj)
                if single:
                    dump.single_profile[single[0]] = single[1]
                dump.other_objects += 1
            else:
                dump.other_objects += 1
            position += 1
    return dump


# --------------------------------------------------------------------------- one pod


def _where(dump: Dump, position: int, meta: Obj) -> str:
    pod = f"{meta.get('namespace', '?')}/{meta.get('name', '?')}"
    return f"{dump.path}: object {position + 1} ({clip(pod)})"


def _latest_stamp(pod: Obj) -> float | None:
    """The latest time written in a pod (creation, start, transitions, container states);
    fields of the wrong shape are left out (:func:`_check_status` refuses them)."""
    meta, status = _mapping(pod.get("metadata")), _mapping(pod.get("status"))
    stamps = [meta.get("creationTimestamp"), status.get("startTime")]
    stamps += [c.get("lastTransitionTime") for c in _object_list(status.get("conditions"))]
    for key in ("containerStatuses", "initContainerStatuses"):
        for cs in _object_list(status.get(key)):
            for state in _mapping(cs.get("state")).values():
                if isinstance(state, dict):
                    stamps += [state.get("startedAt"), state.get("finishedAt")]
    times = [t for t in map(parse_time, stamps) if t is not None]
    return max(times) if times else None


def _scheduled(status: Obj) -> float | None:
    for c in _object_list(status.get("conditions")):
        if c.get("type") == "PodScheduled" and c.get("status") == "True":
            t = parse_time(c.get("lastTransitionTime"))
            if t is not None:
                return t
    return parse_time(status.get("startTime"))


def _finished_at(status: Obj) -> float | None:
    times = [
        parse_time(_mapping(_mapping(cs.get("state")).get("terminated")).get("finishedAt"))
        for cs in _object_list(status.get("containerStatuses"))
    ]
    known = [t for t in times if t is not None]
    return max(known) if known else None


def _check_status(status: Obj, where: str) -> None:
    """Refuse the status fields export reads when their shape is not kubectl's: a list that
    is not a list, a container status or state that is not an object."""
    for key in ("conditions", "containerStatuses", "initContainerStatuses"):
        value = status.get(key)
        if value is not None and not isinstance(value, list):
            raise ExportError(
                f"{where}: status.{key} must be a list, got {type(value).__name__}; {_FIX}"
            )
    for key in ("containerStatuses", "initContainerStatuses"):
        for i, cs in enumerate(status.get(key) or ()):
            state = cs.get("state") if isinstance(cs, dict) else None
            if not isinstance(cs, dict) or not isinstance(state or {}, dict):
                raise ExportError(
                    f"{where}: status.{key}[{i}] must be an object whose 'state' is an object; "
                    f"{_FIX}"
                )


def _read_pod(pod: Obj, dump: Dump, position: int, seen_at: float) -> ObservedPod:
    meta = pod.get("metadata")
    if not isinstance(meta, dict):
        raise ExportError(f"{dump.path}: object {position + 1}: a Pod without metadata; {_FIX}")
    where = _where(dump, position, meta)
    name, namespace = meta.get("name"), meta.get("namespace") or "default"
    if not isinstance(name, str) or not name or not isinstance(namespace, str):
        raise ExportError(f"{where}: metadata.name and metadata.namespace must be strings; {_FIX}")
    created = parse_time(meta.get("creationTimestamp"))
    if created is None:
        raise ExportError(
            f"{where}: metadata.creationTimestamp is missing or not an RFC 3339 time; export "
            f"reads pods as the API server returns them, not manifests: {_FIX}"
        )
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    if not isinstance(spec, dict) or not isinstance(status, dict):
        raise ExportError(f"{where}: spec and status must be objects; {_FIX}")
    _check_status(status, where)
    try:
        requests = pod_requests(pod)
        cpu = cpu_milli(requests.get("cpu", 0))
        mem = memory_mib(requests.get("memory", 0))
    except (QuantityError, TypeError, AttributeError) as e:
        raise ExportError(f"{where}: unreadable resource requests ({e}); {_FIX}") from None
    requests = {r: v for r, v in requests.items() if r not in ("cpu", "memory")}
    renamed: dict[str, str] = {}
    node = spec.get("nodeName")
    profile = dump.single_profile.get(node) if isinstance(node, str) else None
    if profile is not None and WHOLE_GPU in requests:
        mig = mig_resource(profile)
        requests[mig] = requests.get(mig, Decimal(0)) + requests.pop(WHOLE_GPU)
        renamed[mig] = WHOLE_GPU
    priority = spec.get("priority") or 0
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ExportError(f"{where}: spec.priority must be an integer, got {priority!r:.40}")
    phase = status.get("phase")
    finished = _finished_at(status) if phase in _FINISHED else None
    if phase in _FINISHED and finished is None:
        finished = seen_at  # finished, but no container says when: first seen finished
    return ObservedPod(
        namespace=namespace,
        name=name,
        uid=str(meta.get("uid") or ""),
        where=where,
        first_seen=seen_at,
        last_seen=seen_at,
        created=created,
        scheduled=_scheduled(status),
        finished=finished,
        deleted=parse_time(meta.get("deletionTimestamp")),
        requests=requests,
        renamed_from=renamed,
        cpu_milli=cpu,
        memory_mib=mem,
        priority=priority,
        qos=str(status.get("qosClass") or ""),
    )


def _merge(old: ObservedPod, new: ObservedPod) -> ObservedPod:
    """``new`` (a later observation) with what only ``old`` knew."""
    new.first_seen = min(old.first_seen, new.first_seen)
    new.last_seen = max(old.last_seen, new.last_seen)
    new.scheduled = new.scheduled if new.scheduled is not None else old.scheduled
    if old.finished is not None and (new.finished is None or old.finished < new.finished):
        new.finished = old.finished
    if old.deleted is not None and (new.deleted is None or old.deleted < new.deleted):
        new.deleted = old.deleted
    return new


# --------------------------------------------------------------------------- observations


def observe_dumps(dumps: Sequence[Dump], report: ExportReport) -> tuple[list[ObservedPod], float]:
    """Every pod of ``dumps`` (merged by uid over time) and the end of the observation."""
    for dump in dumps:
        report.other_objects += dump.other_objects
        if dump.time is None:
            stamps = [t for t in (_latest_stamp(p) for p, _, _ in dump.pods) if t is not None]
            if not stamps:
                raise ExportError(
                    f"{dump.path}: holds no pod with a timestamp, so when it was taken is unknown; "
                    f"name the time: {dump.path}@2026-11-23T10:00:00Z"
                )
            dump.time, dump.inferred = max(stamps), True
    ordered = sorted(dumps, key=lambda d: d.time or 0.0)
    if any(d.inferred for d in ordered) and len(ordered) > 1:
        report.notes.append(
            "dump times were taken from the latest timestamp inside each dump (a lower bound); "
            "name them as FILE@2026-11-23T10:00:00Z, or put the time in the file names "
            "(pods-$(date -u +%Y%m%dT%H%M%SZ).json), for exact vanishing times"
        )
    if len({d.time for d in ordered}) < len(ordered):
        same = [d.path for d in ordered if sum(e.time == d.time for e in ordered) > 1]
        raise ExportError(
            f"dumps {', '.join(same)} were taken at the same time, so their order is unknown; "
            "name their times as FILE@2026-11-23T10:00:00Z"
        )
    pods: dict[str, ObservedPod] = {}
    for dump in ordered:
        assert dump.time is not None
        for obj, event, position in dump.pods:
            seen = _read_pod(obj, dump, position, dump.time)
            key = seen.uid or seen.key
            if event == "DELETED":  # a watch event: the pod is gone
                gone = seen.finished or seen.deleted or _latest_stamp(obj) or dump.time
                seen.deleted = gone if seen.deleted is None else min(seen.deleted, gone)
            pods[key] = _merge(pods[key], seen) if key in pods else seen
    until = ordered[-1].time
    assert until is not None
    times = sorted(d.time for d in ordered if d.time is not None)
    for p in pods.values():  # times past the last observation (a FILE@TIME named too early)
        if p.finished is not None and p.finished > until:
            p.finished = until
        if p.deleted is not None:
            # deletionTimestamp is the delete request's time plus the grace period, often in
            # the future: the pod is gone by the first dump that no longer shows it, and no
            # end lies past the observation
            after = bisect.bisect_right(times, p.last_seen)
            gone_by = times[after] if after < len(times) else until
            p.deleted = min(p.deleted, gone_by, until)
    return list(pods.values()), until


def export_kubectl(
    specs: Sequence[str],
    name: str | None = None,
    resource_map: Mapping[str, str | None] | None = None,
) -> tuple[Workload, ExportReport]:
    """A workload from kubectl dumps ``FILE[@TIME]`` (module docstring)."""
    if not specs:
        raise ExportError(f"no kubectl dump given; {_FIX}")
    dumps = [read_dump(s) for s in specs]
    report = ExportReport(source="kubectl", files=[d.path for d in dumps])
    observed, end = observe_dumps(dumps, report)
    workload = build_workload(observed, end, report, name or Path(dumps[0].path).stem, resource_map)
    if report.ends.get(END_FINISHED, 0) == 0 and len(dumps) == 1:
        report.notes.append(
            "one dump shows only pods that exist at one moment: take dumps over time (e.g. "
            "every 5 minutes) so pods that end between them are seen to end"
        )
    return workload, report
