"""``gpuslice bench planner``: the planner benchmark (:mod:`simulations.bench_planner`).

Output (``-o``, :mod:`gpuslice.output`): one table row per cluster size, as in the README --
wall time p50 / p99 of CP-SAT and of the greedy baseline, pods placed per instance, eligible
pods left unplaced and weighted churn (sums over the instances), CP-SAT's solver statuses and
whether CP-SAT placed at least the greedy's priority-weighted pods on every instance.
``-o wide`` adds CPU time and the calls over the time limit; ``-o json`` / ``-o yaml`` print the
whole result document (per-plan times, churn parts, gaps, the machine's load).
``--out DIR`` also writes that document to ``DIR/planner.json``.  Progress (one line per
instance) goes to stderr unless ``--quiet``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from gpuslice.cli import BadInput
from gpuslice.output import Column, add_output_argument, emit, render_table

HELP = "run a benchmark: 'planner' compares the CP-SAT planner with the greedy baseline"
REPORT_FILE = "planner.json"
"""The file ``--out DIR`` gets."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from simulations import bench_planner

    parser.add_argument("target", choices=["planner"], help="what to benchmark")
    bench_planner.add_arguments(parser)
    parser.add_argument(
        "--out",
        metavar="DIR",
        help=f"also write the result document to DIR/{REPORT_FILE} (DIR is created)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    add_output_argument(parser, what="the result")


def _times(s: dict[str, Any]) -> str:
    return f"{s['p50']:.3f} / {s['p99']:.3f}"


def _statuses(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} x {status}" for status, n in sorted(counts.items()))


COLUMNS = (
    Column("nodes (GPUs)", lambda r: f"{r['nodes']} ({r['gpus']})"),
    Column("CP-SAT p50 / p99 s", lambda r: _times(r["cpsat"]["solve_s"])),
    Column("greedy p50 / p99 s", lambda r: _times(r["greedy"]["solve_s"])),
    Column("CP-SAT cpu p50 / p99 s", lambda r: _times(r["cpsat"]["cpu_s"]), wide=True),
    Column("greedy cpu p50 / p99 s", lambda r: _times(r["greedy"]["cpu_s"]), wide=True),
    Column(
        "placed, CP-SAT vs greedy",
        lambda r: f"{', '.join(map(str, r['cpsat']['placed']))} vs "
        f"{', '.join(map(str, r['greedy']['placed']))}",
    ),
    Column(
        "eligible unplaced, CP-SAT vs greedy",
        lambda r: f"{sum(r['cpsat']['unplaced_eligible'])} vs "
        f"{sum(r['greedy']['unplaced_eligible'])}",
    ),
    Column(
        "weighted churn, CP-SAT vs greedy",
        lambda r: f"{sum(r['cpsat']['churn_weighted']):,} vs "
        f"{sum(r['greedy']['churn_weighted']):,}",
    ),
    Column("CP-SAT status", lambda r: _statuses(r["cpsat"]["status"])),
    Column(
        "over limit +10%, CP-SAT vs greedy",
        lambda r: f"{r['cpsat']['over_limit_10pct']} vs {r['greedy']['over_limit_10pct']}",
        wide=True,
    ),
    Column("CP-SAT >= greedy", "cpsat_ge_greedy"),
)


def render_text(doc: dict[str, Any], wide: bool = False, width: int | None = None) -> str:
    """The README's table of a :func:`simulations.bench_planner.run_benchmark` result."""
    head = (
        f"planner benchmark: {doc['gpu_model']} x {doc['gpus_per_node']} per node, "
        f"{100 * doc['occupancy']:.0f} % of compute used, pending batch "
        f"{100 * doc['pending_fraction']:.0f} % of the GPUs, {doc['time_limit_s']:g} s limit, "
        f"{doc['num_workers']} worker(s), seed {doc['seed']}; wall time of each plan() call"
    )
    table = render_table(COLUMNS, doc["sizes"], wide=wide, width=width)
    return f"{head}\n{table}"


def _target(out: str | None) -> Path | None:
    """The file ``--out`` means: ``DIR/planner.json``; a value ending in ``.json`` that is not
    a folder is the first releases' ``--out FILE``, kept with a note."""
    if not out:
        return None
    path = Path(out)
    if path.suffix == ".json" and not path.is_dir():
        print(f"gpuslice bench: note: --out FILE is deprecated; give a folder, which gets "
              f"{REPORT_FILE}", file=sys.stderr)  # fmt: skip
        return path
    if path.exists() and not path.is_dir():
        raise BadInput(f"--out {out}: not a folder; give a folder (it gets {REPORT_FILE})")
    return path / REPORT_FILE


def run(args: argparse.Namespace) -> int:
    from simulations import bench_planner

    try:
        instances = bench_planner.check_args(args)
    except ValueError as e:
        raise BadInput(str(e)) from e
    target = _target(args.out)
    doc = bench_planner.run_benchmark(
        args.sizes,
        instances,
        time_limit_s=args.time_limit,
        seed=args.seed,
        num_workers=args.workers,
        gpus_per_node=args.gpus_per_node,
        occupancy=args.occupancy,
        pending_fraction=args.pending_fraction,
        progress=(lambda _: None)
        if args.quiet
        else (lambda line: print(line, file=sys.stderr, flush=True)),
    )
    emit(doc, args.output, lambda wide, width: render_text(doc, wide, width))
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {target}", file=sys.stderr)
    return 0
