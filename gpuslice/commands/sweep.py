"""``gpuslice sweep``: tune the batch window and planner weights with the time replay.

Runs :func:`simulations.replay.sweep.run_sweep` over a grid of batch timeouts, idle times and
planner-weight presets, prints a table (``-o``, :mod:`gpuslice.output`) and recommends a
setting by the churn-aware rule of :func:`simulations.replay.sweep.recommend`: among the runs that
disrupt no pod and meet no planner error, the lowest p95 pending time -- but a setting with more
than ``--max-extra-churn`` % more reconfigurations per hour than the calmest such run must
lower p95 pending time by at least ``--min-p95-gain`` % (defaults 10 and 5), else the calmer
setting wins.  Exit code 1 when no setting qualifies.

Without ``--trace``/``--cluster`` it uses the small built-in scenario
(:func:`simulations.replay.sweep.default_scenario`).  ``--trace`` needs ``--cluster`` (a workload
means nothing on a cluster it was not written for; ``--cluster builtin`` runs it on the
built-in one on purpose).  Nothing is written unless ``--out DIR`` is given: then ``sweep.json``
(the ``-o json`` document) and ``sweep.png`` (p95 per setting) go there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from gpuslice.cli import BadInput
from gpuslice.options import BUILTIN_CLUSTER, deprecated_alias, trace_needs_cluster
from gpuslice.output import Column, add_output_argument, emit, render_table

HELP = "tune batch timeout/idle and planner weights with the time replay; recommends a setting"
WRITES = ("sweep.json", "sweep.png")
"""What ``--out DIR`` gets."""


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


def _percent(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage, got {text!r}") from None
    if not 0 <= value < 100:
        raise argparse.ArgumentTypeError(f"expected 0 <= percent < 100, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from simulations.replay.sweep import DEFAULT_CHURN_BAND, DEFAULT_MIN_GAIN

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
        help="planner weight presets: default, low-churn, keep-free (comma-separated; "
        "default default,low-churn)",
    )
    parser.add_argument(
        "--policy", choices=["cpsat", "greedy"], default="cpsat", help="planner (default cpsat)"
    )
    parser.add_argument(
        "--trace",
        help="openb trace name (default, gpushare40, ...), openb CSV, or workload YAML/JSON "
        "(needs --cluster); default: the built-in synthetic workload",
    )
    parser.add_argument(
        "--cluster",
        help="cluster YAML/JSON (pools of any GPU models and modes), 'openb', or 'builtin'; "
        "default: the built-in 2 x 4 A100-80GB MIG nodes",
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
        "--batch-retry-seconds",
        dest="retry",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="the partitioner's batch retry for planned pods still pending, as its "
        "--batch-retry-seconds (default 60)",
    )
    deprecated_alias(parser, "--retry", "--batch-retry-seconds", "retry", type=float)
    parser.add_argument(
        "--mapping",
        default=None,
        help="mapping of fractional requests (mig-compute, mig-memory, mps-memory[:G]; "
        "default by node mode)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for the trace copies' offsets")
    parser.add_argument(
        "--max-extra-churn",
        type=_percent,
        default=100 * DEFAULT_CHURN_BAND,
        metavar="PERCENT",
        help="reconfigurations per hour above the calmest qualifying setting's that still "
        "count as no more churn (default %(default)g)",
    )
    parser.add_argument(
        "--min-p95-gain",
        type=_percent,
        default=100 * DEFAULT_MIN_GAIN,
        metavar="PERCENT",
        help="how much lower p95 pending time a setting with more churn than that must "
        "reach (default %(default)g)",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        help=f"write {' and '.join(WRITES)} into this folder (created if missing); "
        "default: write nothing",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    add_output_argument(parser, what="the sweep")


def _load_workload(args: argparse.Namespace) -> object:
    from simulations.inputs.openb import OPENB_TRACES, load_openb_pods, resolve_trace
    from simulations.inputs.workload import load_workload

    trace: str = args.trace
    if trace in OPENB_TRACES or trace.endswith(".csv"):
        return load_openb_pods(resolve_trace(trace, args.openb_dir))
    return load_workload(trace)


ROW_COLUMNS = (
    Column("timeout s", lambda r: f"{r['timeout_s']:g}", align="right"),
    Column("idle s", lambda r: f"{r['idle_s']:g}", align="right"),
    Column("weights", "weights"),
    Column("p50 s", lambda r: f"{r['pending_p50_s']:.0f}", align="right"),
    Column("p95 s", lambda r: f"{r['pending_p95_s']:.0f}", align="right"),
    Column("p99 s", lambda r: f"{r['pending_p99_s']:.0f}", align="right", wide=True),
    Column("never", "never_scheduled", align="right"),
    Column("reconf/h", lambda r: f"{r['reconfigurations_per_hour']:.2f}", align="right"),
    Column("GPUs reconf", "gpus_reconfigured", align="right", wide=True),
    Column("disrupted", "pods_disrupted", align="right"),
    Column("plans", "plans", align="right", wide=True),
    Column("plan ms p95", lambda r: f"{r['planner_ms_p95']:.1f}", align="right", wide=True),
    Column("planner errors", "planner_errors", align="right", wide=True),
    Column("recommended", lambda r: "<- yes" if r["recommended"] else ""),
)


def sweep_document(
    args: argparse.Namespace, workload: Any, cluster: Any, rows: Any, best: Any, note: str | None
) -> dict[str, Any]:
    """What ``-o json`` prints and ``--out`` keeps as ``sweep.json``."""
    return {
        "policy": args.policy,
        "workload": workload.name,
        "cluster": cluster.summary(),
        "rule": {
            "max_extra_churn_pct": args.max_extra_churn,
            "min_p95_gain_pct": args.min_p95_gain,
        },
        "rows": [
            {
                "timeout_s": r.point.timeout_s,
                "idle_s": r.point.idle_s,
                "weights": r.point.weights,
                "recommended": r is best,
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
        "note": note,
    }


def render_text(doc: dict[str, Any], wide: bool = False, width: int | None = None) -> str:
    lines = [render_table(ROW_COLUMNS, doc["rows"], wide=wide, width=width), ""]
    best = next((r for r in doc["rows"] if r["recommended"]), None)
    if best is None:
        lines.append("no setting ran without disruptions and planner errors; nothing to recommend")
    else:
        lines.append(
            f"recommended: batch timeout {best['timeout_s']:g} s, idle {best['idle_s']:g} s, "
            f"weights {best['weights']} (p95 pending {best['pending_p95_s']:.0f} s, "
            f"{best['reconfigurations_per_hour']:.2f} reconfigurations/h, "
            f"{best['pods_disrupted']} disruptions)"
        )
    if doc["note"]:
        lines.append(doc["note"])
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from gpuslice.progress import Progress
    from simulations.inputs.cluster import ClusterError, load_cluster
    from simulations.inputs.workload import Workload, WorkloadError
    from simulations.replay.engine import ReplayError, ReplaySettings, parse_policy
    from simulations.replay.static_layouts import StaticLayoutError
    from simulations.replay.sweep import (
        SweepError,
        churn_note,
        default_scenario,
        grid,
        plot_sweep,
        recommend,
        run_sweep,
    )

    trace_needs_cluster("sweep", args.trace, args.cluster)
    out = Path(args.out) if args.out else None
    if out is not None and out.exists() and not out.is_dir():
        raise BadInput(f"--out {args.out}: not a folder; give a folder for {', '.join(WRITES)}")
    band, gain = args.max_extra_churn / 100, args.min_p95_gain / 100
    try:
        workload, cluster = default_scenario()
        if args.trace:
            loaded = _load_workload(args)
            assert isinstance(loaded, Workload)
            workload = loaded
        if args.cluster and args.cluster != BUILTIN_CLUSTER:
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

    if not args.quiet:
        print(
            f"sweep: {len(points)} runs, policy {args.policy}, {len(workload)} pods on "
            f"{cluster.summary()}",
            file=sys.stderr,
        )
    with Progress("sweep", len(points), enabled=not args.quiet) as bar:
        try:
            rows = run_sweep(
                workload,
                cluster,
                points,
                parse_policy(args.policy),
                settings,
                lambda i, n, row: bar.update(i, row.point.label()),
            )
        except (ReplayError, StaticLayoutError) as e:
            raise BadInput(str(e)) from e
    best = recommend(rows, band, gain)
    doc = sweep_document(args, workload, cluster, rows, best, churn_note(rows, best, band, gain))
    emit(doc, args.output, lambda wide, width: render_text(doc, wide, width))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "sweep.json").write_text(json.dumps(doc, indent=2) + "\n")
        plot = plot_sweep(rows, best, out / "sweep.png")
        print(f"wrote {out / 'sweep.json'} and {plot}", file=sys.stderr)
    return 0 if best is not None else 1
