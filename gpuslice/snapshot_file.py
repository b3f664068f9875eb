"""Reading a kubectl snapshot file and checking every field the planner's reader uses.

Model
-----
``gpuslice plan --snapshot FILE`` takes the JSON of ``kubectl get nodes,pods,nodepartitionings
-A -o json``.  :func:`read_snapshot_file` reads it within :data:`contract.input_files.
MAX_SNAPSHOT_BYTES` (UTF-8/16/32 with a BOM, standard JSON, no ``NaN``/``1e400``/duplicate
keys) and then :func:`check_kubectl_list` checks, item by item, exactly the fields
:func:`partitioner.snapshot.snapshot_from_kubectl_list` and :mod:`partitioner.eligibility` read,
before they read them:

* the document is a List of at most :data:`MAX_ITEMS` mappings;
* Nodes, Pods and NodePartitionings have a ``metadata`` mapping with a non-empty ``name``
  (Pods also a ``namespace``), no two of a kind share a name, labels and annotations map
  strings to strings, owner references are mappings;
* every resource quantity (node ``status.allocatable``, container ``requests``/``limits``, pod
  ``overhead``) is a Kubernetes quantity -- a string or a number, not ``true``, within int64 --
  as the API server itself requires;
* GPU Feature Discovery's ``nvidia.com/gpu.count`` and ``nvidia.com/gpu.memory`` are ASCII
  (as every label value the API server accepts; ``²`` is a digit to Python's ``str.isdigit``
  only) and ``gpu.memory`` is at most 16 TiB.  A huge
  ``nvidia.com/gpu.count`` is *not* refused here: it is what the cluster says, so the plan
  reports that node as a problem (``TooManyGpus``, the node left out) and plans the rest;
* node selectors, node affinity terms, tolerations, taints, pod conditions, priority and the
  scalar fields next to them have the API's types;
* a NodePartitioning's ``spec.gpus``/``status.gpus`` indices are GPU indices, and
  ``status.gpus`` names each once, so no status is silently ignored (a spec naming a GPU twice,
  a hand edit the API server admits, is read: the plan leaves that node out with a note).
  They are *not* checked against ``nvidia.com/gpu.count``: the reader takes them as the
  controller does.  A status naming more GPUs than the label is the agent's report, which wins
  (the count mismatch is a note with its fix, :func:`partitioner.adoption._reported`: a second
  GPU model GFD does not count, a stale label); a spec naming a GPU the node no longer has (it
  lost one, Xid 79: GFD relabels ``gpu.count``, the spec written before still names it) is the
  agent's ``NoSuchGpu``, not a fault of the file, and exporting again would not change it.

Fields gpuslice does not read (``managedFields``, container images, ...) are not checked.  The
first problem found ends the check with a :class:`SnapshotFileError` naming the file, the item
(kind and name) and the field, and saying what to fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from contract.input_files import MAX_SNAPSHOT_BYTES, InputError, parse_json, read_text
from contract.nodepartitioning import KIND as NP_KIND
from partitioner.quantities import QuantityError, parse_quantity

__all__ = ["MAX_ITEMS", "SnapshotFileError", "check_kubectl_list", "read_snapshot_file"]

MAX_ITEMS = 300_000
"""Objects in one dump (Kubernetes' limits: 5,000 nodes, 150,000 pods)."""
MAX_GPU_MEMORY_LABEL_MIB = 16 * 1024 * 1024
MAX_NAME = 253
"""Kubernetes object names (DNS subdomain) are at most 253 characters."""
MAX_STRING = 65536
_QUANTITY_LIMIT = Decimal(2**63 - 1)
_INT32 = 2**31 - 1
_KINDS = ("Node", "Pod", NP_KIND)
GPU_COUNT_LABEL = "nvidia.com/gpu.count"
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"
_FIX = "export it again with 'kubectl get nodes,pods,nodepartitionings -A -o json'"


class SnapshotFileError(ValueError):
    """The snapshot file cannot be planned from; the message names file, item, field and fix."""


def read_snapshot_file(path: str) -> dict[str, Any]:
    """Read, parse and check a kubectl List (``-``: standard input)."""
    where = "standard input" if path == "-" else path
    try:
        text = read_text(path, "snapshot", MAX_SNAPSHOT_BYTES)
        doc = parse_json(text, f"snapshot file {where}", check_depth=False)
    except InputError as e:
        message = str(e)
        if "not valid JSON" in message:
            message += f"; create it with {_FIX.removeprefix('export it again with ')}"
        raise SnapshotFileError(message) from None
    check_kubectl_list(doc, where)
    assert isinstance(doc, dict)
    return doc


class _Bad(Exception):
    """A field is wrong: ``(where in the item, problem)``."""


def _mapping(v: Any, at: str, *, optional: bool = True) -> Mapping[str, Any]:
    if v is None and optional:
        return {}
    if not isinstance(v, dict):
        raise _Bad(at, f"expected a mapping, got {_kind(v)}")
    return v


def _list(v: Any, at: str) -> list[Any]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise _Bad(at, f"expected a list, got {_kind(v)}")
    return v


def _string(v: Any, at: str, *, max_len: int = MAX_STRING, optional: bool = True) -> str:
    if v is None and optional:
        return ""
    if not isinstance(v, str):
        raise _Bad(at, f"expected a string, got {_kind(v)}")
    if len(v) > max_len:
        raise _Bad(at, f"longer than {max_len} characters")
    return v


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"the boolean {str(v).lower()}"
    if isinstance(v, int | float):
        return f"the number {v!r}"
    if isinstance(v, str):
        return f"the string {v[:40]!r}"
    if isinstance(v, dict):
        return "a mapping"
    return "a list" if isinstance(v, list) else type(v).__name__


def _string_map(v: Any, at: str) -> Mapping[str, str]:
    m = _mapping(v, at)
    for key, value in m.items():
        _string(value, f"{at}[{key!r}]", optional=False)
    return m


def _quantity(v: Any, at: str) -> None:
    if isinstance(v, bool) or not isinstance(v, str | int | float):
        raise _Bad(at, f"expected a quantity such as '500m', '2' or '1Gi', got {_kind(v)}")
    if isinstance(v, str) and len(v) > 64:
        raise _Bad(at, f"quantity {v[:40]!r}... is longer than 64 characters")
    try:
        value = parse_quantity(v)
    except QuantityError as e:
        raise _Bad(at, str(e)) from None
    except ArithmeticError:  # the exponent overflows Decimal's context
        value = _QUANTITY_LIMIT + 1
    if not Decimal(0) <= value <= _QUANTITY_LIMIT:
        raise _Bad(at, f"quantity {v!r} is outside 0..2^63-1, which the API server allows")


def _quantities(v: Any, at: str) -> None:
    for name, q in _mapping(v, at).items():
        _quantity(q, f"{at}[{name!r}]")


def _metadata(item: Mapping[str, Any], kind: str) -> tuple[str, str, Mapping[str, str]]:
    meta = _mapping(item.get("metadata"), "metadata", optional=False)
    name = _string(meta.get("name"), "metadata.name", max_len=MAX_NAME)
    if not name:
        raise _Bad("metadata.name", "missing or empty; every object needs its name")
    namespace = ""
    if kind == "Pod":
        namespace = _string(meta.get("namespace"), "metadata.namespace", max_len=MAX_NAME)
        if not namespace:
            raise _Bad("metadata.namespace", "missing or empty; pods live in a namespace")
    labels = _string_map(meta.get("labels"), "metadata.labels")
    _string_map(meta.get("annotations"), "metadata.annotations")
    for k, owner in enumerate(_list(meta.get("ownerReferences"), "metadata.ownerReferences")):
        at = f"metadata.ownerReferences[{k}]"
        _string(_mapping(owner, at, optional=False).get("kind"), f"{at}.kind")
    _string(meta.get("deletionTimestamp"), "metadata.deletionTimestamp")
    return name, namespace, labels


def _label_int(labels: Mapping[str, str], key: str, limit: int | None) -> int | None:
    """A numeric GFD label's value (``None``: absent, not a number or over 12 digits -- the
    reader reports those itself); not ASCII (no Kubernetes label value is: ``²``, other
    scripts' digits) or beyond ``limit`` (if any): an error."""
    raw = labels.get(key)
    if raw is None:
        return None
    at = f"metadata.labels[{key!r}]"
    if not raw.isascii():
        raise _Bad(at, f"{raw[:20]!r} is not a label value (ASCII only); write the number in 0-9")
    digits = raw.strip()
    if not digits.isdigit():
        return None
    if len(digits) > 12:
        if limit is None:
            return None
        raise _Bad(at, f"{raw[:20]!r} is more than {limit:,}")
    value = int(digits)
    if limit is not None and value > limit:
        raise _Bad(at, f"{raw[:20]!r} is more than {limit:,}")
    return value


def _taints(v: Any, at: str) -> None:
    for k, t in enumerate(_list(v, at)):
        t = _mapping(t, f"{at}[{k}]", optional=False)
        for f in ("key", "value", "effect"):
            _string(t.get(f), f"{at}[{k}].{f}")


def _check_node(item: Mapping[str, Any]) -> None:
    spec = _mapping(item.get("spec"), "spec")
    _taints(spec.get("taints"), "spec.taints")
    if not isinstance(spec.get("unschedulable", False), bool | None):
        raise _Bad(
            "spec.unschedulable", f"expected true or false, got {_kind(spec['unschedulable'])}"
        )
    status = _mapping(item.get("status"), "status")
    _quantities(status.get("allocatable"), "status.allocatable")


def _expressions(v: Any, at: str) -> None:
    for k, e in enumerate(_list(v, at)):
        e = _mapping(e, f"{at}[{k}]", optional=False)
        _string(e.get("key"), f"{at}[{k}].key")
        _string(e.get("operator"), f"{at}[{k}].operator")
        for j, value in enumerate(_list(e.get("values"), f"{at}[{k}].values")):
            _string(value, f"{at}[{k}].values[{j}]", optional=False)


def _check_affinity(v: Any) -> None:
    affinity = _mapping(v, "spec.affinity")
    node = _mapping(affinity.get("nodeAffinity"), "spec.affinity.nodeAffinity")
    req_at = "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
    required = _mapping(node.get("requiredDuringSchedulingIgnoredDuringExecution"), req_at)
    for k, term in enumerate(
        _list(required.get("nodeSelectorTerms"), f"{req_at}.nodeSelectorTerms")
    ):
        t_at = f"{req_at}.nodeSelectorTerms[{k}]"
        term = _mapping(term, t_at, optional=False)
        _expressions(term.get("matchExpressions"), f"{t_at}.matchExpressions")
        _expressions(term.get("matchFields"), f"{t_at}.matchFields")


def _check_pod(item: Mapping[str, Any]) -> None:
    spec = _mapping(item.get("spec"), "spec")
    for field in ("containers", "initContainers"):
        for k, c in enumerate(_list(spec.get(field), f"spec.{field}")):
            at = f"spec.{field}[{k}]"
            res = _mapping(_mapping(c, at, optional=False).get("resources"), f"{at}.resources")
            _quantities(res.get("requests"), f"{at}.resources.requests")
            _quantities(res.get("limits"), f"{at}.resources.limits")
    _quantities(spec.get("overhead"), "spec.overhead")
    _string(spec.get("nodeName"), "spec.nodeName", max_len=MAX_NAME)
    priority = spec.get("priority")
    if priority is not None and (
        isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > _INT32
    ):
        raise _Bad("spec.priority", f"expected a 32-bit integer, got {_kind(priority)}")
    _string_map(spec.get("nodeSelector"), "spec.nodeSelector")
    _check_affinity(spec.get("affinity"))
    for k, tol in enumerate(_list(spec.get("tolerations"), "spec.tolerations")):
        tol = _mapping(tol, f"spec.tolerations[{k}]", optional=False)
        for f in ("key", "operator", "value", "effect"):
            _string(tol.get(f), f"spec.tolerations[{k}].{f}")
    status = _mapping(item.get("status"), "status")
    _string(status.get("phase"), "status.phase")
    _string(status.get("nominatedNodeName"), "status.nominatedNodeName", max_len=MAX_NAME)
    for k, cond in enumerate(_list(status.get("conditions"), "status.conditions")):
        cond = _mapping(cond, f"status.conditions[{k}]", optional=False)
        for f in ("type", "status", "reason"):
            _string(cond.get(f), f"status.conditions[{k}].{f}")


def _gpu_indices(v: Any, at: str, once: bool = True) -> list[tuple[int, str]]:
    """``(index, where)`` of each entry of a NodePartitioning gpus list, each index once
    (``once``; else an index may repeat)."""
    out: list[tuple[int, str]] = []
    seen: set[int] = set()
    for k, g in enumerate(_list(v, at)):
        g = _mapping(g, f"{at}[{k}]", optional=False)
        index = g.get("index")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= _INT32:
            raise _Bad(f"{at}[{k}].index", f"expected a GPU index (0, 1, ...), got {_kind(index)}")
        if once and index in seen:
            raise _Bad(f"{at}[{k}].index", f"GPU {index} is listed twice; list each GPU once")
        seen.add(index)
        out.append((index, f"{at}[{k}].index"))
    return out


def _check_partitioning(item: Mapping[str, Any]) -> None:
    # A spec listing a GPU twice (a hand edit the API server admits) is read: the plan notes
    # the node as InvalidPartitioning and leaves it out, as the controller does.
    _gpu_indices(_mapping(item.get("spec"), "spec").get("gpus"), "spec.gpus", once=False)
    _gpu_indices(_mapping(item.get("status"), "status").get("gpus"), "status.gpus")


def check_kubectl_list(doc: Any, where: str) -> None:
    """Raise :class:`SnapshotFileError` at the first field the reader could not use."""
    if not isinstance(doc, dict) or not isinstance(doc.get("items"), list):
        raise SnapshotFileError(
            f"snapshot file {where}: expected a Kubernetes List with an 'items' array; {_FIX}"
        )
    items: list[Any] = doc["items"]
    if len(items) > MAX_ITEMS:
        raise SnapshotFileError(
            f"snapshot file {where}: {len(items):,} items, more than {MAX_ITEMS:,}; dump only "
            "the nodes, pods and nodepartitionings gpuslice plans with"
        )
    seen: dict[tuple[str, str], int] = {}
    for i, item in enumerate(items):
        label = f"items[{i}]"
        try:
            if not isinstance(item, dict):
                raise _Bad("", f"expected a Kubernetes object (a mapping), got {_kind(item)}")
            kind = item.get("kind")
            if kind is not None and not isinstance(kind, str):
                raise _Bad("kind", f"expected a string, got {_kind(kind)}")
            if kind not in _KINDS:
                continue  # not read
            label = f"items[{i}] ({kind})"
            name, namespace, labels = _metadata(item, kind)
            label = f"items[{i}] ({kind} {namespace + '/' if namespace else ''}{name})"
            key = (kind, f"{namespace}/{name}")
            if key in seen:
                raise _Bad(
                    "metadata.name",
                    f"the same {kind} as items[{seen[key]}]; keep one of them",
                )
            seen[key] = i
            if kind == "Node":
                _label_int(labels, GPU_COUNT_LABEL, None)
                _label_int(labels, GPU_MEMORY_LABEL, MAX_GPU_MEMORY_LABEL_MIB)
                _check_node(item)
            elif kind == "Pod":
                _check_pod(item)
            else:
                _check_partitioning(item)
        except _Bad as bad:
            at, problem = bad.args
            raise SnapshotFileError(
                f"snapshot file {where}: {label}: {at + ': ' if at else ''}{problem}"
            ) from None
