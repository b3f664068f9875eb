"""``gpuslice nos-check``: what changes for a cluster's pods and nodes when gpuslice replaces nos.

Reads a cluster dump (``kubectl get nodes,pods -A -o json``) and lists every pod requesting an
MPS slice (``nvidia.com/gpu-<N>gb``: N x 1000 MiB under nos, N GiB under gpuslice, which also
keeps memory for the MPS server), how many such slices fit per GPU before and after on the
GPU models it can run on, and the request that keeps nos's packing where fewer fit; then the
nodes still carrying nos's annotations or device-plugin label (:mod:`partitioner.nos_migration`).
Output (``-o``, :mod:`gpuslice.output`): a table with one row per pod and GPU model (how many
of its slices fit one GPU under nos and under gpuslice, and the fix), then one row per node
note; ``-o wide`` adds the sizes in MiB; ``-o json`` / ``-o yaml`` one document.
Exit code 0 (also when pods are listed), 2 for a bad file.
"""

from __future__ import annotations

import argparse
from typing import Any

from gpuslice.cli import BadInput
from gpuslice.commands.plan import _load_catalog, read_reading
from gpuslice.options import add_catalog_argument
from gpuslice.output import Column, add_output_argument, emit, render_table
from planner.demand import MIB_PER_GIB
from planner.snapshot import mps_resource

HELP = "list the pods and nodes whose meaning changes when gpuslice replaces nos"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--snapshot",
        metavar="FILE",
        required=True,
        help="JSON from 'kubectl get nodes,pods -A -o json' ('-' = stdin)",
    )
    parser.add_argument(
        "--mps-reserve-mib",
        type=int,
        default=512,
        help="GPU memory gpuslice keeps for the MPS server (chart partitioner.planner."
        "mpsReserveMiB; default 512)",
    )
    add_catalog_argument(parser)
    add_output_argument(parser, json_alias=True, what="the pods and nodes")


def _fix(nos_mib: int, fit: dict[str, Any]) -> str:
    """What to do about one pod's request on one GPU model."""
    if fit["nos"] == 0 and fit["gpuslice"] == 0:
        return "fits no GPU of this model under either: ask for less memory"
    if fit["gpuslice"] >= fit["nos"]:
        return "nothing to do"
    if fit["keep_with"] is not None:
        mib = fit["keep_with"] * MIB_PER_GIB
        return (
            f"to keep {fit['nos']} per GPU request {mps_resource(fit['keep_with'])} "
            f"({mib} MiB, {100 * (nos_mib - mib) / nos_mib:.1f} % less than nos gave)"
        )
    return f"no gpuslice size fits {fit['nos']} per GPU; plan for {fit['gpuslice']}"


POD_COLUMNS = (
    Column("pod", "pod"),
    Column("node", lambda r: r["node"] or "(pending)"),
    Column("request", "resource"),
    Column("nos MiB", "nos_mib", wide=True, align="right"),
    Column("gpuslice MiB", "gpuslice_mib", wide=True, align="right"),
    Column("GPU model", "model"),
    Column("per GPU nos", "per_gpu_nos", align="right"),
    Column("per GPU gpuslice", "per_gpu_gpuslice", align="right"),
    Column("fix", "fix"),
)
NODE_COLUMNS = (Column("node", "node"), Column("note", "message"))


def _pod_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for p in doc["pods"]:
        base = {k: p[k] for k in ("pod", "node", "resource", "nos_mib", "gpuslice_mib")}
        if p.get("refused"):
            rows.append(base | {"fix": f"gpuslice refuses the pod as it asks: {p['refused']}"})
            continue
        for f in p["fits"]:
            rows.append(
                base
                | {
                    "model": f["model"],
                    "per_gpu_nos": f["nos"],
                    "per_gpu_gpuslice": f["gpuslice"],
                    "fix": _fix(p["nos_mib"], f),
                }
            )
        if not p["fits"]:
            rows.append(base | {"fix": "no opted-in MPS node with readable GPU labels to compare on"})
    return rows


def render_text(
    doc: dict[str, Any], reserve_mib: int, wide: bool = False, width: int | None = None
) -> str:
    """The table form of the nos-check document."""
    pods, nodes = doc["pods"], doc["nodes"]
    fewer = sum(p["fewer_fit"] for p in pods)
    lines = [
        f"{len(pods)} MPS request(s) change meaning (N x 1000 MiB under nos, N GiB plus an "
        f"MPS server reserve of {reserve_mib} MiB per GPU under gpuslice); for "
        f"{fewer} of them fewer fit per GPU. MIG requests mean the same."
    ]
    if pods:
        lines += ["", render_table(POD_COLUMNS, _pod_rows(doc), wide=wide, width=width), ""]
        lines.append(
            "MPS pods run under nos's MPS server, which leaves with nos's device-plugin fork: "
            "drain them before the switch and recreate them with the requests above."
        )
    lines.append("")
    if nodes:
        lines += [f"Nodes ({len(nodes)} note(s)):", render_table(NODE_COLUMNS, nodes, width=width)]
    else:
        lines.append("Nodes: nothing of nos left.")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from partitioner.nos_migration import check

    if args.mps_reserve_mib < 0:
        raise BadInput(f"--mps-reserve-mib must be >= 0, got {args.mps_reserve_mib}")
    catalog = _load_catalog(args.catalog)
    dump, reading, _ = read_reading(args.snapshot, catalog)
    items = dump["items"]
    pods = [i for i in items if isinstance(i, dict) and i.get("kind") == "Pod"]
    nodes = [i for i in items if isinstance(i, dict) and i.get("kind") == "Node"]
    changes, notes = check(pods, nodes, reading, args.mps_reserve_mib)
    doc: dict[str, Any] = {
        "pods": [
            {
                "pod": c.pod,
                "resource": c.resource,
                "node": c.node,
                "nos_mib": c.nos_mib,
                "gpuslice_mib": c.gpuslice_mib,
                "fewer_fit": c.fewer_fit,
                "refused": c.refused,
                "fits": [
                    {
                        "model": f.model,
                        "nos": f.nos,
                        "gpuslice": f.gpuslice,
                        "keep_with": f.keep_with,
                    }
                    for f in c.fits
                ],
            }
            for c in changes
        ],
        "nodes": [{"node": n.node, "message": n.message} for n in notes],
    }
    emit(doc, args.output, lambda wide, width: render_text(doc, args.mps_reserve_mib, wide, width))
    return 0
