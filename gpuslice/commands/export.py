"""``gpuslice export``: a workload file from your cluster's pods, in its own resource names.

Reads kubectl dumps of the pods taken over time (:mod:`simulations.export.kubectl`) or
kube-state-metrics series (:mod:`simulations.export.ksm`), told apart by their content unless
``--from`` says, and prints the workload (:mod:`simulations.export.pods`; format in
docs/workloads.md) as YAML, or JSON with ``-o json``.  ``--out FILE`` writes it to a file
instead (JSON when FILE ends in ``.json``); nothing is written unless asked.  What was read, skipped, renamed and how each pod's
end was decided goes to stderr (``--quiet``: only errors) and into the file's ``export`` block.

Replay the result with ``gpuslice simulate --protocol time-replay --trace FILE --cluster
CLUSTER.yaml`` or ``gpuslice sweep --trace FILE --cluster CLUSTER.yaml``.  Bad input (an
unreadable file, a GPU resource the simulator cannot replay, a malformed ``--map-resource``)
exits with code 2 and a message naming the file or pod and the fix.

Needs no extra: it runs wherever gpuslice is installed (the container image too).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from gpuslice.cli import BadInput
from gpuslice.output import add_output_argument

HELP = (
    "build a workload file from your cluster's pods (kubectl dumps over time or "
    "kube-state-metrics series), for simulate/sweep"
)

SOURCES = ("kubectl", "ksm")
_SNIFF_BYTES = 65536
_METRIC_LINE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*(\{|\s+[-+0-9.NnIi])")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "files",
        nargs="+",
        metavar="FILE[@TIME]",
        help="kubectl dumps (kubectl get pods -A -o json, one per moment; @TIME: when it was "
        "taken, RFC 3339) or kube-state-metrics data (Prometheus query_range JSON or /metrics text)",
    )
    parser.add_argument(
        "--from",
        dest="source",
        choices=SOURCES,
        help="what the files are (default: told from their content)",
    )
    parser.add_argument(
        "--map-resource",
        action="append",
        default=[],
        metavar="FROM=TO",
        help="rename a resource before export, e.g. nvidia.com/gpu.shared=nvidia.com/gpu-10gb "
        "or nvidia.com/mig-1g.5gb=nvidia.com/mig-1g.10gb; FROM= drops it (repeatable)",
    )
    parser.add_argument(
        "--priority-class",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="kube-state-metrics only: the priority of a PriorityClass (repeatable)",
    )
    parser.add_argument("--name", help="workload name (default: the first file's name)")
    add_output_argument(parser, formats=("yaml", "json"), what="the workload")
    parser.add_argument(
        "--out",
        metavar="FILE",
        help="write the workload into FILE instead of printing it (a .json FILE gets JSON)",
    )
    parser.add_argument("--quiet", action="store_true", help="no report on stderr")


def sniff(path: str) -> str:
    """``kubectl`` or ``ksm`` from a file's first bytes (``kubectl`` when unsure)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(_SNIFF_BYTES).decode("utf-8", errors="replace").lstrip("\ufeff")
    except OSError:
        return "kubectl"  # the reader names the problem
    text = head.lstrip()
    if text[:1] in ("{", "["):
        return (
            "ksm"
            if '"resultType"' in head or '"status":"success"' in head.replace(" ", "")
            else "kubectl"
        )
    for line in text.splitlines():
        if line.strip():
            return (
                "ksm"
                if line.startswith(("# HELP", "# TYPE")) or _METRIC_LINE.match(line)
                else "kubectl"
            )
    return "kubectl"


def run(args: argparse.Namespace) -> int:
    from simulations.export.pods import ExportError, render, split_at, workload_document
    from simulations.inputs.gpu_resources import ResourceMapError, parse_resource_map
    from simulations.inputs.workload import WorkloadError

    try:
        resource_map = parse_resource_map(args.map_resource)
        kinds = {f: args.source or sniff(split_at(f)[0]) for f in args.files}
        if len(set(kinds.values())) > 1:
            listed = "; ".join(f"{f}: {k}" for f, k in kinds.items())
            raise BadInput(
                f"the files are of different kinds ({listed}); export kubectl dumps and "
                "kube-state-metrics data separately, or say which with --from"
            )
        kind = next(iter(kinds.values()))
        if kind == "kubectl":
            if args.priority_class:
                raise BadInput(
                    "--priority-class is for kube-state-metrics data; kubectl dumps carry each "
                    "pod's spec.priority"
                )
            from simulations.export.kubectl import export_kubectl

            workload, report = export_kubectl(args.files, args.name, resource_map)
        else:
            from simulations.export.ksm import export_ksm, parse_priority_classes

            classes = parse_priority_classes(args.priority_class)
            workload, report = export_ksm(args.files, args.name, resource_map, classes)
    except (ExportError, ResourceMapError, WorkloadError) as e:
        raise BadInput(str(e)) from None
    fmt = "json" if args.out and args.out.lower().endswith(".json") else args.output
    text = render(workload_document(workload, report), fmt)
    if not args.quiet:
        for line in report.lines():
            print(line, file=sys.stderr)
    if args.out:
        try:
            Path(args.out).write_text(text)
        except OSError as e:
            raise BadInput(f"cannot write --out {args.out}: {e.strerror or e}") from None
        if not args.quiet:
            print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
