"""Simulated clusters: node types, the YAML cluster description, and the openb node list.

Model
-----
A :class:`Node` is one machine: CPU (milli-cores) and memory (MiB) allocatable, ``gpus``
identical GPUs of ``model``, and the partitioning ``mode`` (``mig``, ``mps`` or ``hybrid``, as in
:class:`planner.snapshot.Mode`).  ``model`` is the label pods' ``gpu_spec`` lists match against;
``catalog_model`` is the :mod:`planner.catalog` model name when one is known (the openb trace's
``G2``/``G3`` GPUs have none; such nodes can only run the GPU-share protocols).
A :class:`Cluster` is a named tuple of nodes with unique names.

Cluster file (YAML or JSON)
---------------------------
::

    name: demo
    pools:
      - name: a100            # node names: a100-000, a100-001, ...
        count: 16
        gpu_model: A100-SXM4-80GB   # any name or product label planner.catalog resolves
        gpus_per_node: 8
        cpu_milli: 96000
        memory_mib: 786432
        mode: mps             # mig | mps | hybrid (mig/hybrid need a MIG-capable model)
      - name: cpu
        count: 4
        gpus_per_node: 0      # CPU-only nodes: no gpu_model
        cpu_milli: 64000
        memory_mib: 262144

Errors name the file, the pool (``pools[1] (cpu)``) and the field to fix.

openb node list
---------------
:func:`load_openb_nodes` reads ``openb_node_list_gpu_node.csv`` (``sn, cpu_milli, memory_mib,
gpu, model``) in file order, with line-numbered errors; models map to the catalog through
:data:`OPENB_MODEL_TO_CATALOG`.  All openb nodes are ``mps`` (GPU sharing), as in the FGD paper.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.catalog import CatalogError, default_catalog
from planner.snapshot import Mode
from simulations.inputs.documents import named_entry, read_document
from simulations.inputs.limits import MAX_CPU_MILLI, MAX_GPUS_PER_NODE, MAX_MEMORY_MIB, MAX_NODES
from simulations.inputs.openb import TraceError, openb_dir, raise_collected, read_csv_rows

__all__ = [
    "OPENB_MODEL_TO_CATALOG",
    "OPENB_NODE_FILE",
    "Cluster",
    "ClusterError",
    "Node",
    "load_cluster",
    "load_cluster_file",
    "load_openb_nodes",
    "parse_cluster",
]

OPENB_NODE_FILE = "openb_node_list_gpu_node.csv"
OPENB_MODEL_TO_CATALOG: Mapping[str, str | None] = {
    "P100": "P100",
    "T4": "T4",
    "V100M16": "V100-16GB",
    "V100M32": "V100-32GB",
    "A10": "A10",
    "G2": None,  # Alibaba-internal GPU generations: no public catalog entry
    "G3": None,
}


class ClusterError(ValueError):
    """A cluster description is invalid; the message names the file, pool and field."""


@dataclass(frozen=True, slots=True)
class Node:
    """One node of a simulated cluster."""

    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str = ""
    """GPU model label matched by pods' ``gpu_spec`` (empty for CPU-only nodes)."""
    mode: Mode = Mode.MPS
    catalog_model: str | None = None
    """:mod:`planner.catalog` model name, when known."""

    def __post_init__(self) -> None:
        if self.cpu_milli < 0 or self.memory_mib < 0 or self.gpus < 0:
            raise ClusterError(f"node {self.name!r}: cpu_milli, memory_mib and gpus must be >= 0")
        if self.gpus > 0 and not self.model:
            raise ClusterError(f"node {self.name!r}: has {self.gpus} GPUs but no GPU model")


@dataclass(frozen=True, slots=True)
class Cluster:
    """A named set of nodes (unique names)."""

    name: str
    nodes: tuple[Node, ...]
    source: str = ""

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ClusterError(f"cluster {self.name!r}: has no nodes")
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ClusterError(f"cluster {self.name!r}: duplicate node name {dup!r}")

    @property
    def total_gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)

    @property
    def max_node_cpu_milli(self) -> int:
        return max(n.cpu_milli for n in self.nodes)

    @property
    def max_node_gpus(self) -> int:
        return max(n.gpus for n in self.nodes)

    def summary(self) -> str:
        """``1213 nodes, 6212 GPUs (G2 4392, T4 842, ...)``."""
        per: dict[str, int] = {}
        for n in self.nodes:
            if n.gpus:
                per[n.model] = per.get(n.model, 0) + n.gpus
        models = ", ".join(f"{m} {c}" for m, c in sorted(per.items(), key=lambda kv: -kv[1]))
        return f"{len(self.nodes)} nodes, {self.total_gpus} GPUs ({models})"


# --------------------------------------------------------------------------- YAML description

_POOL_FIELDS = {"name", "count", "gpu_model", "gpus_per_node", "cpu_milli", "memory_mib", "mode"}


_POOL_MAX = {
    "count": MAX_NODES,
    "gpus_per_node": MAX_GPUS_PER_NODE,
    "cpu_milli": MAX_CPU_MILLI,
    "memory_mib": MAX_MEMORY_MIB,
}
"""Upper bounds of the pool fields (simulations.inputs.limits)."""


def _pool_int(d: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int:
    if key not in d:
        if default is None:
            raise ClusterError(f"{where}: missing required field {key!r}")
        return default
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ClusterError(f"{where}: field {key!r} must be a non-negative integer, got {v!r}")
    if v > _POOL_MAX[key]:
        raise ClusterError(f"{where}: field {key!r} is {v:,}; the limit is {_POOL_MAX[key]:,}")
    return v


def _parse_pool(entry: object, where: str) -> list[Node]:
    d, name, where = named_entry(
        entry, _POOL_FIELDS, where, ClusterError, "(name, count, gpu_model, ...)"
    )
    count = _pool_int(d, "count", where)
    if count < 1:
        raise ClusterError(f"{where}: count must be >= 1")
    gpus = _pool_int(d, "gpus_per_node", where)
    cpu = _pool_int(d, "cpu_milli", where)
    mem = _pool_int(d, "memory_mib", where)
    try:
        mode = Mode(str(d.get("mode", "mps")).lower())
    except ValueError:
        raise ClusterError(
            f"{where}: mode {d.get('mode')!r} is not one of {', '.join(m.value for m in Mode)}"
        ) from None
    model_name = ""
    if gpus > 0:
        raw = d.get("gpu_model")
        if not isinstance(raw, str) or not raw:
            raise ClusterError(f"{where}: gpus_per_node is {gpus}, so 'gpu_model' is required")
        try:
            model = default_catalog().model(raw)
        except CatalogError:
            known = ", ".join(m.name for m in default_catalog().models)
            raise ClusterError(
                f"{where}: unknown GPU model {raw!r}; the simulator knows the built-in "
                f"catalog's models ({known}): use one of them (catalog override files apply "
                "to the partitioner, the agent, plan, status and nos-check, not to the "
                "what-if commands)"
            ) from None
        if mode in (Mode.MIG, Mode.HYBRID) and not model.mig_capable:
            raise ClusterError(
                f"{where}: mode {mode.value} needs a MIG-capable GPU; {model.name} is not "
                "(use mode: mps)"
            )
        model_name = model.name
    elif "gpu_model" in d:
        raise ClusterError(f"{where}: gpu_model is set but gpus_per_node is 0")
    width = max(3, len(str(count - 1)))
    return [
        Node(
            name=f"{name}-{i:0{width}d}",
            cpu_milli=cpu,
            memory_mib=mem,
            gpus=gpus,
            model=model_name,
            mode=mode,
            catalog_model=model_name or None,
        )
        for i in range(count)
    ]


def parse_cluster(doc: object, where: str, default_name: str = "cluster") -> Cluster:
    """Build a :class:`Cluster` from a parsed YAML/JSON document (see the module docstring)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("pools"), list) or not doc["pools"]:
        raise ClusterError(f"{where}: expected a mapping with a non-empty 'pools' list")
    name = doc.get("name") or default_name
    if not isinstance(name, str):
        raise ClusterError(f"{where}: field 'name' must be a string, got {name!r:.60}")
    total = 0  # counted before any node is built
    for i, pool in enumerate(doc["pools"]):
        if isinstance(pool, dict) and "count" in pool:
            total += _pool_int(
                pool, "count", f"{where}: pools[{i}] ({pool.get('name', '?')!s:.60})"
            )
            if total > MAX_NODES:
                raise ClusterError(
                    f"{where}: pools[{i}]: the pools add up to more than {MAX_NODES:,} nodes; "
                    "simulate a smaller cluster"
                )
    nodes: list[Node] = []
    for i, pool in enumerate(doc["pools"]):
        nodes.extend(_parse_pool(pool, f"{where}: pools[{i}]"))
    try:
        return Cluster(name=name, nodes=tuple(nodes), source=where)
    except ClusterError as e:
        raise ClusterError(f"{where}: {e} (pool names must differ)") from None


def load_cluster_file(path: str | Path) -> Cluster:
    p = Path(path)
    doc = read_document(p, ClusterError, "cluster")
    return parse_cluster(doc, str(p), default_name=p.stem)


# --------------------------------------------------------------------------- openb node list


def load_openb_nodes(path: str | Path) -> Cluster:
    """Read ``openb_node_list_gpu_node.csv`` into a :class:`Cluster` (file order)."""
    p = Path(path)
    where = str(p)
    errors: list[str] = []
    nodes: list[Node] = []
    seen: dict[str, int] = {}
    for row in read_csv_rows(p, ("sn", "cpu_milli", "memory_mib", "gpu", "model")):
        n_err = len(errors)
        sn = row.values["sn"].strip()
        model = row.values["model"].strip()
        if not sn:
            errors.append(f"{where}:{row.line}: column 'sn' is empty")
        elif sn in seen:
            errors.append(f"{where}:{row.line}: duplicate node {sn!r} (first on line {seen[sn]})")
        cpu = row.integer("cpu_milli", errors, where, MAX_CPU_MILLI)
        mem = row.integer("memory_mib", errors, where, MAX_MEMORY_MIB)
        gpus = row.integer("gpu", errors, where, MAX_GPUS_PER_NODE)
        if len(errors) == n_err and (cpu < 0 or mem < 0 or gpus < 0):
            errors.append(f"{where}:{row.line}: cpu_milli, memory_mib and gpu must be >= 0")
        if len(errors) == n_err and gpus > 0 and not model:
            errors.append(f"{where}:{row.line}: node {sn!r} has {gpus} GPUs but no model")
        if len(errors) > n_err:
            continue
        seen[sn] = row.line
        nodes.append(
            Node(
                name=sn,
                cpu_milli=cpu,
                memory_mib=mem,
                gpus=gpus,
                model=model if gpus else "",
                mode=Mode.MPS,
                catalog_model=OPENB_MODEL_TO_CATALOG.get(model) if gpus else None,
            )
        )
    raise_collected(p, errors)
    if not nodes:
        raise TraceError(f"{where}: no node rows after the header")
    return Cluster(name="openb", nodes=tuple(nodes), source=where)


def load_cluster(spec: str, openb_directory: str | Path | None = None) -> Cluster:
    """``openb`` (the openb GPU node list), a node-list CSV, or a YAML/JSON cluster file."""
    if spec == "openb":
        return load_openb_nodes(openb_dir(openb_directory) / OPENB_NODE_FILE)
    p = Path(spec)
    if p.is_dir():
        raise ClusterError(f"cluster file {spec} is a directory; give a cluster file or 'openb'")
    if not p.is_file():
        raise ClusterError(f"cluster {spec!r}: not 'openb' and no such file")
    if p.suffix == ".csv":
        return load_openb_nodes(p)
    return load_cluster_file(p)
