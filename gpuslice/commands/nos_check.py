"""``gpuslice nos-check``: what changes for a cluster's pods and nodes when gpuslice replaces nos.

Reads a cluster dump (``kubectl get nodes,pods -A -o json``) and lists every pod requesting an
MPS slice (``nvidia.com/gpu-<N>gb``: N x 1000 MiB under nos, N GiB under gpuslice, which also
keeps memory for the MPS server), how many such slices fit per GPU before and after on the
GPU models it can run on, and the request that keeps nos's packing where fewer fit; then the
nodes still carrying nos's annotations or device-plugin label (:mod:`partitioner.nos_migration`).
Exit code 0 (also when pods are listed), 2 for a bad file.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from gpuslice.cli import BadInput
from gpuslice.commands.plan import _load_catalog, read_reading

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
    parser.add_argument(
        "--catalog", action="append", default=[], metavar="FILE", help="GPU catalog override file"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")


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
    if args.json:
        doc: dict[str, Any] = {
            "pods": [
                {
                    "pod": c.pod,
                    "resource": c.resource,
                    "node": c.node,
                    "nos_mib": c.nos_mib,
                    "gpuslice_mib": c.gpuslice_mib,
                    "fewer_fit": c.fewer_fit,
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
        print(json.dumps(doc, indent=2))
        return 0
    fewer = sum(c.fewer_fit for c in changes)
    print(
        f"{len(changes)} MPS request(s) change meaning (N x 1000 MiB under nos, N GiB plus an "
        f"MPS server reserve of {args.mps_reserve_mib} MiB per GPU under gpuslice); for "
        f"{fewer} of them fewer fit per GPU. MIG requests mean the same."
    )
    for c in changes:
        print(c.describe())
    if changes:
        print(
            "MPS pods run under nos's MPS server, which leaves with nos's device-plugin fork: "
            "drain them before the switch and recreate them with the requests above."
        )
    print(f"Nodes ({len(notes)} note(s)):" if notes else "Nodes: nothing of nos left.")
    for n in notes:
        print(f"  {n.node}: {n.message}")
    return 0
