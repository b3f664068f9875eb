"""``gpuslice sweep``: tune the batch window and planner weights with the time replay.

Runs :func:`simulations.sweep.run_sweep` over a grid of batch timeouts, idle times and
planner-weight presets, prints a table, recommends the setting with the smallest p95 pending
time at zero disruption, and writes ``sweep.png`` and ``sweep.json`` into ``--out``.
Without ``--trace``/``--cluster`` it uses the small built-in scenario
(:func:`simulations.sweep.default_scenario`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gpuslice.cli import BadInput

HELP = "tune batch timeout/idle and planner weights with the time replay; recommends a setting"


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated seconds, got {text!r}"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive seconds, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timeouts",
        type=_floats,
        default=[10.0, 30.0, 60.0],
        help="batch timeouts, s (comma-separated; default 10,30,60)",
    )
    parser.add_argument(
        "--idles", type=_floats, default=[2.0, 10.0], help="batch idle times, s (default 2,10)"
    )
    parser.add_argument(
        "--weights",
        default="default,low-churn",
        help="planner weight presets: default, low-churn, keep-free (comma-separated)",
    )
    parser.add_argument(
        "--policy", choices=["cpsat", "greedy"], default="cpsat", help="planner (default cpsat)"
    )
    parser.add_argument(
        "--trace",
        help="openb trace name (default, gpushare40, ...), openb CSV, or workload YAML/JSON; default: built-in synthetic workload",
    )
    parser.add_argument(
        "--cluster",
        help="cluster YAML/JSON (one GPU model and mode); default: built-in 2 x 4 A100-80GB MIG nodes",
    )
    parser.add_argument(
        "--openb-dir",
        help="directory of the openb CSVs (else $GPUSLICE_OPENB_DIR or ../shared/traces/openb)",
    )
    parser.add_argument(
        "--compression", type=float, default=1.0, help="divide trace times by this (default 1)"
    )
    parser.add_argument(
        "--copies", type=int, default=1, help="overlaid copies of the trace (default 1)"
    )
    parser.add_argument(
        "--apply-delay", type=float, default=5.0, help="node agent apply delay, s (default 5)"
    )
    parser.add_argument(
        "--retry",
        type=float,
        default=60.0,
        help="partitioner retry time for unplaced pods, s (default 60)",
    )
    parser.add_argument(
        "--mapping",
        default=None,
        help="mapping of fractional requests (mig-compute, mig-memory, mps-memory[:G]; "
        "default by node mode)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for the trace copies' offsets")
    parser.add_argument(
        "--out",
        default="gpuslice-sweep",
        help="output directory for sweep.png and sweep.json (default ./gpuslice-sweep)",
    )


def _load_workload(args: argparse.Namespace) -> object:
    from simulations.openb import OPENB_TRACES, load_openb_pods, resolve_trace
    from simulations.workload import load_workload

    trace: str = args.trace
    if trace in OPENB_TRACES or trace.endswith(".csv"):
        return load_openb_pods(resolve_trace(trace, args.openb_dir))
    return load_workload(trace)


def run(args: argparse.Namespace) -> int:
    from simulations.cluster import ClusterError, load_cluster
    from simulations.replay import ReplayError, ReplaySettings, parse_policy
    from simulations.static_layouts import StaticLayoutError
    from simulations.sweep import (
        SweepError,
        default_scenario,
        grid,
        plot_sweep,
        recommend,
        run_sweep,
        sweep_table,
    )
    from simulations.workload import Workload, WorkloadError

    try:
        workload, cluster = default_scenario()
        if args.trace:
            loaded = _load_workload(args)
            assert isinstance(loaded, Workload)
            workload = loaded
        if args.cluster:
            cluster = load_cluster(args.cluster, args.openb_dir)
        points = grid(
            args.timeouts, args.idles, [w.strip() for w in args.weights.split(",") if w.strip()]
        )
        settings = ReplaySettings(
            batch_retry_s=args.retry,
            apply_delay_s=args.apply_delay,
            time_compression=args.compression,
            copies=args.copies,
            seed=args.seed,
            mapping=args.mapping,
        )
    except (WorkloadError, ClusterError, SweepError, ReplayError, StaticLayoutError) as e:
        raise BadInput(str(e)) from e

    def progress(i: int, n: int, row: object) -> None:
        print(f"\rsweep: {i}/{n} runs", end="" if i < n else "\n", file=sys.stderr, flush=True)

    print(
        f"sweep: {len(points)} runs, policy {args.policy}, {len(workload)} pods on {cluster.summary()}",
        file=sys.stderr,
    )
    try:
        rows = run_sweep(workload, cluster, points, parse_policy(args.policy), settings, progress)
    except (ReplayError, StaticLayoutError) as e:
        raise BadInput(str(e)) from e
    best = recommend(rows)
    print(sweep_table(rows, best))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot = plot_sweep(rows, best, out / "sweep.png")
    doc = {
        "policy": args.policy,
        "workload": workload.name,
        "cluster": cluster.summary(),
        "rows": [
            {
                "timeout_s": r.point.timeout_s,
                "idle_s": r.point.idle_s,
                "weights": r.point.weights,
                **r.summary.as_dict(),
            }
            for r in rows
        ],
        "recommended": None
        if best is None
        else {
            "timeout_s": best.point.timeout_s,
            "idle_s": best.point.idle_s,
            "weights": best.point.weights,
        },
    }
    (out / "sweep.json").write_text(json.dumps(doc, indent=2) + "\n")
    if best is None:
        print("no setting ran without disruptions and planner errors; nothing to recommend")
        return 1
    print(
        f"recommended: batch timeout {best.point.timeout_s:g} s, idle {best.point.idle_s:g} s, "
        f"weights {best.point.weights} (p95 pending {best.summary.pending_p95_s:.0f} s, "
        f"{best.summary.pods_disrupted} disruptions); plot {plot}"
    )
    return 0
