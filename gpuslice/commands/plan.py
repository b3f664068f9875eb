"""``gpuslice plan``: plan one pending batch and show the layout per GPU, assignments, reasons.

Input is the built-in demo cluster (``--demo``, :func:`simulations.inputs.instances.demo_snapshot`)
or a cluster dump (``--snapshot FILE``, the JSON of ``kubectl get nodes,pods -A -o json``,
plus ``nodepartitionings`` once gpuslice's CRD is installed; read by
:func:`partitioner.snapshot.read_kubectl_list`).  The plan comes from
:func:`planner.api.plan` with the chosen policy; nothing is written to any cluster.

For a dump, the output starts with what was read and assumed about each opted-in node: the
GPU model, the MIG strategy its GPU Feature Discovery labels are in, where the GPU count came
from, the instances adopted (before gpuslice's agent reports: :mod:`partitioner.adoption`),
which are in use, and which GPUs are locked; or why the node cannot be planned.

Output (``-o``, :mod:`gpuslice.output`): by default a summary line and three tables -- the
layout of each changed GPU before and after, with MIG instances as ``profile@start``
(``(used)`` marks instances in use, which never move) and MPS slices as
``<GiB>gb/<thread %>%``; the pod assignments; a reason per unplaced pod.  ``-o wide`` adds the
GPU model and the full resource names; ``-o json`` / ``-o yaml`` print the same as one
document (:func:`plan_document`; ``--json`` is a deprecated spelling of ``-o json``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from gpuslice.cli import BadInput
from gpuslice.options import (
    MAX_SEED,
    MAX_TIME_LIMIT_S,
    add_catalog_argument,
    catalog_files,
    check_number,
)
from gpuslice.output import Column, add_output_argument, emit, render_table
from planner.api import plan
from planner.catalog import Catalog, CatalogError
from planner.settings import PlannerSettings, Policy
from planner.snapshot import GpuState, Mode, NodeState, Plan, PlannedGpu, Snapshot

HELP = "plan a pending batch (built-in demo or a kubectl snapshot) and print the layouts"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--demo", action="store_true", help="plan the built-in demo cluster and pending batch"
    )
    source.add_argument(
        "--snapshot",
        metavar="FILE",
        help="JSON from 'kubectl get nodes,pods -A -o json' (add ',nodepartitionings' once "
        "gpuslice is installed; '-' = stdin)",
    )
    parser.add_argument(
        "--policy",
        choices=[p.value for p in Policy],
        default=Policy.CPSAT.value,
        help="planner: cpsat (default) or the nos-like greedy baseline",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=1.0,
        help=f"CP-SAT time limit, seconds (above 0, at most {MAX_TIME_LIMIT_S:g}; default 1)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help=f"CP-SAT random seed (0 to {MAX_SEED}; default 0)"
    )
    add_catalog_argument(parser)
    add_output_argument(parser, json_alias=True, what="the plan")


def _load_catalog(files: Sequence[str]) -> Catalog:
    """The built-in catalog with the ``--catalog`` values' files on top."""
    from contract.catalog_files import load_catalog

    try:
        return load_catalog(catalog_files(files))
    except CatalogError as e:
        raise BadInput(str(e)) from e


def read_dump(path: str) -> Any:
    """The kubectl dump in ``path`` (``-`` = standard input), bounded and checked field by field
    before anything reads it (:mod:`gpuslice.snapshot_file`); :class:`BadInput` naming it."""
    from gpuslice.snapshot_file import SnapshotFileError, read_snapshot_file

    try:
        return read_snapshot_file(path)
    except SnapshotFileError as e:
        raise BadInput(str(e)) from e


def read_reading(path: str, catalog: Catalog) -> tuple[Any, Any, dict[str, list[str]]]:
    """The dump in ``path``, its :class:`partitioner.snapshot.ClusterReading`, and per node
    what was assumed to read it as gpuslice will see it once installed: the GPU Operator's
    MIG manager and device plugin off on opted-in nodes (:func:`partitioner.node_labels.
    with_operands_off`; the partitioner leaves a node out until they are)."""
    from partitioner.node_labels import with_operands_off
    from partitioner.snapshot import opted_in, read_kubectl_list

    doc = read_dump(path)
    assumed: dict[str, list[str]] = {}
    items = doc.get("items") if isinstance(doc, dict) else None
    if isinstance(items, list):
        fixed = []
        for item in items:
            if isinstance(item, dict) and item.get("kind") == "Node" and opted_in(item):
                item, notes = with_operands_off(item)
                if notes:
                    assumed[str(item["metadata"].get("name", ""))] = notes
            fixed.append(item)
        doc = {**doc, "items": fixed}
    try:
        return doc, read_kubectl_list(doc, catalog), assumed
    except (ValueError, CatalogError) as e:
        where = "standard input" if path == "-" else path
        raise BadInput(f"snapshot file {where}: {e}") from e


def _read_snapshot(
    path: str, catalog: Catalog
) -> tuple[Snapshot, list[str], dict[str, dict[str, Any]], dict[str, str], dict[str, str]]:
    """The planner input, the notes on what was left out, the nodes read, the pending pods
    refused before planning (a name no GPU advertises, two MPS slices, no eligible node), with
    why: they are unplaced pods of the batch as much as those the planner could not place; and
    per candidate the nodes it may use that no plan may touch now, with why (an unplaced pod's
    reason names them: the planner's reason speaks of the other nodes only)."""
    from partitioner.snapshot import reading_notes

    _, reading, assumed = read_reading(path, catalog)
    refused = {p: f"cannot place: {r}" for p, r in reading.rejected.items()}
    # pods whose every eligible node is left out (busy, stuck, a node problem) are not in the
    # planner's batch: unplaced by this plan as much as the refused ones, with their reason
    refused.update({p: f"waiting: {r}" for p, r in reading.waiting.items() if p not in refused})
    return (
        reading.snapshot(),
        reading_notes(reading),
        nodes_read(reading, assumed),
        refused,
        dict(reading.left_out),
    )


def nodes_read(
    reading: Any, assumed: dict[str, list[str]] | None = None
) -> dict[str, dict[str, Any]]:
    """Per opted-in node of a :class:`partitioner.snapshot.ClusterReading`: what was read
    (``assumed``: sentences to put first, per node)."""
    out: dict[str, dict[str, Any]] = {}
    for name in sorted({*reading.gpu_nodes, *reading.problems}):
        entry: dict[str, Any] = {}
        node = reading.gpu_nodes.get(name)
        if node is not None:
            entry["model"] = node.model.name
            entry["mode"] = node.mode.value
            if node.labels is not None:
                entry["mig_strategy"] = node.labels.strategy.value
        adopted = reading.adopted.get(name)
        entry["assumed"] = list((assumed or {}).get(name, ()))
        if adopted is not None:
            entry["gpus"] = adopted.gpu_count
            entry["source"] = adopted.source
            entry["assumed"] += adopted.notes
            entry["locked_gpus"] = [g.index for g in adopted.gpus if g.locked]
        problem = reading.problems.get(name)
        if problem is not None:
            entry["problem"] = f"{problem.reason}: {problem.message}"
        out[name] = entry
    return out


def _gib(mib: int) -> str:
    return f"{mib // 1024}gb" if mib % 1024 == 0 else f"{mib}MiB"


def _before(node: NodeState, gpu: GpuState) -> list[str]:
    if node.mode is Mode.MPS:
        return [
            _gib(s.memory_mib)
            + (f"/{s.thread_percentage}%" if s.thread_percentage is not None else "")
            + (" (used)" if s.used else "")
            for s in gpu.mps
        ]
    return [
        f"{i.profile}@{i.start}" + (" (used)" if i.used else "")
        for i in sorted(gpu.mig, key=lambda i: i.start)
    ]


def _after(node: NodeState, gpu: GpuState, planned: PlannedGpu) -> list[str]:
    if node.mode is Mode.MPS:
        return [
            f"{_gib(s.memory_mib)}/{s.thread_percentage}%" + (" (used)" if s.used else "")
            for s in planned.mps
        ]
    used = {(i.profile, i.start) for i in gpu.mig if i.used}
    return [f"{p}@{s}" + (" (used)" if (p, s) in used else "") for p, s in planned.mig]


def plan_document(snapshot: Snapshot, result: Plan, seconds: float) -> dict[str, Any]:
    """The plan as a JSON-ready document (also the source of the text output)."""
    layouts = []
    for node in sorted(snapshot.nodes, key=lambda n: n.name):
        for gpu in sorted(node.gpus, key=lambda g: g.index):
            planned = result.layouts.get((node.name, gpu.index))
            if planned is None:
                continue
            layouts.append(
                {
                    "node": node.name,
                    "gpu": gpu.index,
                    "mode": node.mode.value,
                    "model": node.model,
                    "before": _before(node, gpu),
                    "after": _after(node, gpu, planned),
                }
            )
    return {
        "nodes_read": {},
        "policy": result.policy,
        "status": result.status,
        "seconds": round(seconds, 4),
        "nodes": len(snapshot.nodes),
        "gpus": sum(len(n.gpus) for n in snapshot.nodes),
        "pending_pods": len(snapshot.pods),
        "layouts": layouts,
        "assignments": {
            name: {"node": a.node, "gpus": {r: list(ix) for r, ix in sorted(a.gpus.items())}}
            for name, a in sorted(result.assignments.items())
        },
        "unplaced": dict(sorted(result.unplaced.items())),
        "stats": dict(sorted(result.stats.items())),
    }


def _render_nodes(nodes: dict[str, dict[str, Any]]) -> list[str]:
    lines = [f"Read from the dump ({len(nodes)} opted-in node(s)):"]
    for name, n in nodes.items():
        head = ", ".join(str(n[k]) for k in ("model", "mode") if k in n) + (
            f", mig.strategy={n['mig_strategy']}" if "mig_strategy" in n else ""
        )
        lines.append(f"  {name} ({head})" if head else f"  {name}")
        lines += [f"    - {a}" for a in n.get("assumed", ())]
        if "problem" in n:
            lines.append(f"    - not planned: {n['problem']}")
    return [*lines, ""]


LAYOUT_COLUMNS = (
    Column("node", "node"),
    Column("gpu", "gpu", align="right"),
    Column("mode", "mode"),
    Column("model", "model", wide=True),
    Column("before", "before"),
    Column("after", "after"),
)
ASSIGNMENT_COLUMNS = (
    Column("pod", "pod"),
    Column("node", "node"),
    Column("slices", "slices"),
    Column("resources", "resources", wide=True),
)
UNPLACED_COLUMNS = (Column("pod", "pod"), Column("reason", "reason"))


def _assignment_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "pod": name,
            "node": a["node"],
            "slices": "; ".join(
                f"{r.removeprefix('nvidia.com/')} on GPU {', '.join(map(str, ix))}"
                for r, ix in a["gpus"].items()
            ),
            "resources": sorted(a["gpus"]),
        }
        for name, a in doc["assignments"].items()
    ]


def render_text(doc: dict[str, Any], wide: bool = False, width: int | None = None) -> str:
    """The table form of :func:`plan_document`'s document (``wide``: ``-o wide``)."""
    lines = _render_nodes(doc["nodes_read"]) if doc["nodes_read"] else []
    lines += [
        f"Planned {doc['pending_pods']} pending pod(s) on {doc['nodes']} node(s) / "
        f"{doc['gpus']} GPU(s) with policy {doc['policy']} "
        f"(status {doc['status'] or '-'}, {doc['seconds']:.2f} s).",
        "",
        f"Layout changes ({len(doc['layouts'])} GPU(s); all other GPUs stay as they are):",
    ]

    def section(columns: tuple[Column, ...], rows: list[dict[str, Any]]) -> None:
        lines.append(render_table(columns, rows, wide=wide, width=width) if rows else "(none)")

    section(LAYOUT_COLUMNS, doc["layouts"])
    lines += ["", f"Assignments ({len(doc['assignments'])}):"]
    section(ASSIGNMENT_COLUMNS, _assignment_rows(doc))
    lines += ["", f"Unplaced ({len(doc['unplaced'])}):"]
    section(UNPLACED_COLUMNS, [{"pod": p, "reason": r} for p, r in doc["unplaced"].items()])
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    check_number("--time-limit", args.time_limit, 0, MAX_TIME_LIMIT_S, above=True, unit=" s")
    check_number("--seed", args.seed, 0, MAX_SEED)
    catalog = _load_catalog(args.catalog)
    warnings: list[str] = []
    read: dict[str, dict[str, Any]] = {}
    refused: dict[str, str] = {}
    left_out: dict[str, str] = {}
    if args.demo:
        from simulations.inputs.instances import demo_snapshot

        snapshot = demo_snapshot()
    else:
        snapshot, warnings, read, refused, left_out = _read_snapshot(args.snapshot, catalog)
    for w in warnings:
        print(f"gpuslice plan: note: {w}", file=sys.stderr)
    settings = PlannerSettings(
        policy=Policy(args.policy), time_limit_s=args.time_limit, seed=args.seed
    )
    start = time.perf_counter()
    try:
        result = plan(snapshot, settings, catalog)
    except ValueError as e:  # SnapshotError, InvalidLayout, CatalogError
        source = "the demo snapshot" if args.demo else f"snapshot file {args.snapshot}"
        raise BadInput(f"{source}: {e}") from e
    doc = plan_document(snapshot, result, time.perf_counter() - start)
    for key, nodes in left_out.items():
        if key in doc["unplaced"]:
            doc["unplaced"][key] += f"; left out of this plan, though the pod may use them: {nodes}"
    doc["pending_pods"] += len(refused)
    doc["unplaced"] = dict(sorted({**doc["unplaced"], **refused}.items()))
    doc["nodes_read"] = read
    doc["warnings"] = warnings
    emit(doc, args.output, lambda wide, width: render_text(doc, wide, width))
    return 0
