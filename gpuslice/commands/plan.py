"""``gpuslice plan``: plan one pending batch and show the layout per GPU, assignments, reasons.

Input is the built-in demo cluster (``--demo``, :func:`simulations.instances.demo_snapshot`)
or a cluster dump (``--snapshot FILE``, the JSON of
``kubectl get nodes,pods,nodepartitionings -A -o json``, converted by
:func:`partitioner.snapshot.snapshot_from_kubectl_list`).  The plan comes from
:func:`planner.api.plan` with the chosen policy; nothing is written to any cluster.

Text output, per changed GPU: ``node GPU i: [before] -> [after]`` with MIG instances as
``profile@start`` (``(used)`` marks instances in use, which never move) and MPS slices as
``<GiB>gb/<thread %>%``; then the pod assignments and a reason per unplaced pod.  ``--json``
prints the same as one JSON document.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from gpuslice.cli import BadInput
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
        help="JSON from 'kubectl get nodes,pods,nodepartitionings -A -o json' ('-' = stdin)",
    )
    parser.add_argument(
        "--policy",
        choices=[p.value for p in Policy],
        default=Policy.CPSAT.value,
        help="planner: cpsat (default) or the nos-like greedy baseline",
    )
    parser.add_argument(
        "--time-limit", type=float, default=1.0, help="CP-SAT time limit, seconds (default 1)"
    )
    parser.add_argument("--seed", type=int, default=0, help="CP-SAT random seed (default 0)")
    parser.add_argument(
        "--catalog",
        action="append",
        default=[],
        metavar="FILE",
        help="GPU catalog override file (JSON or YAML); repeatable",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")


def _load_catalog(files: Sequence[str]) -> Catalog:
    from contract.catalog_files import load_catalog

    try:
        return load_catalog(files)
    except CatalogError as e:
        raise BadInput(str(e)) from e


def _read_snapshot(path: str, catalog: Catalog) -> tuple[Snapshot, list[str]]:
    from gpuslice.snapshot_file import SnapshotFileError, read_snapshot_file
    from partitioner.snapshot import snapshot_from_kubectl_list

    where = "standard input" if path == "-" else path
    try:
        doc = read_snapshot_file(path)  # every field the reader uses is checked first
    except SnapshotFileError as e:
        raise BadInput(str(e)) from e
    try:
        return snapshot_from_kubectl_list(doc, catalog)
    except (ValueError, CatalogError) as e:
        raise BadInput(f"snapshot file {where}: {e}") from e


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


def render_text(doc: dict[str, Any]) -> str:
    lines = [
        f"Planned {doc['pending_pods']} pending pod(s) on {doc['nodes']} node(s) / "
        f"{doc['gpus']} GPU(s) with policy {doc['policy']} "
        f"(status {doc['status'] or '-'}, {doc['seconds']:.2f} s).",
        "",
        f"Layout changes ({len(doc['layouts'])} GPU(s); all other GPUs stay as they are):",
    ]
    for g in doc["layouts"]:
        kind = " (MPS)" if g["mode"] == Mode.MPS.value else ""
        lines.append(
            f"  {g['node']} GPU {g['gpu']}{kind}: [{', '.join(g['before'])}] -> "
            f"[{', '.join(g['after'])}]"
        )
    if not doc["layouts"]:
        lines.append("  (none)")
    lines += ["", f"Assignments ({len(doc['assignments'])}):"]
    width = max((len(n) for n in doc["assignments"]), default=0)
    for name, a in doc["assignments"].items():
        units = "; ".join(
            f"{r.removeprefix('nvidia.com/')} on GPU {', '.join(map(str, ix))}"
            for r, ix in a["gpus"].items()
        )
        lines.append(f"  {name:<{width}} -> {a['node']}: {units}")
    if not doc["assignments"]:
        lines.append("  (none)")
    lines += ["", f"Unplaced ({len(doc['unplaced'])}):"]
    for name, reason in doc["unplaced"].items():
        lines.append(f"  {name}: {reason}")
    if not doc["unplaced"]:
        lines.append("  (none)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.time_limit <= 0:
        raise BadInput(f"--time-limit must be positive, got {args.time_limit}")
    catalog = _load_catalog(args.catalog)
    warnings: list[str] = []
    if args.demo:
        from simulations.instances import demo_snapshot

        snapshot = demo_snapshot()
    else:
        snapshot, warnings = _read_snapshot(args.snapshot, catalog)
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
    if args.json:
        doc["warnings"] = warnings
        print(json.dumps(doc, indent=2))
    else:
        print(render_text(doc))
    return 0
