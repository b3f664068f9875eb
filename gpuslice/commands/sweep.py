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
(the ``-o json`` document) and ``sweep.png`` (p95 per setting) go there; the folder is made
before the first run (exit 2 when it cannot be), and should writing still fail at the end, the
table has been printed already.

Every numeric option is finite and in the range its help states (:mod:`gpuslice.options`); the
upper bounds (a day of simulated seconds, :data:`MAX_COPIES` copies, ...) only keep a typo
from running for ever.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from gpuslice.cli import BadInput
from gpuslice.options import (
    BUILTIN_CLUSTER,
    DAY_S,
    deprecated_alias,
    integer,
    number,
    numbers,
    out_folder,
    range_text,
    trace_needs_cluster,
)
from gpuslice.output import Column, add_output_argument, emit, render_table

HELP = "tune batch timeout/idle and planner weights with the time replay; recommends a setting"
WRITES = ("sweep.json", "sweep.png")
"""What ``--out DIR`` gets."""
MAX_COPIES = 100
"""Most overlaid copies of the trace (``--copies``): each copy is the whole trace again."""
MIN_COMPRESSION, MAX_COMPRESSION = 1e-3, 1e6
"""``--compression`` range: a thousand times slower to a million times faster than the trace."""

_seconds = number(0, DAY_S, unit=" s")
_window = numbers(0, DAY_S, above=True, unit=" s")


def _percent(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage, got {text!r}") from None
    if not 0 <= value < 100:  # False for nan, as for inf
        raise argparse.ArgumentTypeError(f"expected 0 <= percent < 100, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from simulations.replay.sweep import DEFAULT_CHURN_BAND, DEFAULT_MIN_GAIN

    parser.add_argument(
        "--timeouts",
        type=_window,
        default=[10.0, 30.0, 60.0],
        help=f"batch timeouts, s (comma-separated, each {range_text(0, DAY_S, above=True)}; "
        "default 10,30,60)",
    )
    parser.add_argument(
        "--idles",
        type=_window,
        default=[2.0, 10.0],
        help=f"batch idle times, s (each {range_text(0, DAY_S, above=True)}; default 2,10)",
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
        "--compression",
        type=number(MIN_COMPRESSION, MAX_COMPRESSION),
        default=1.0,
        help=f"divide trace times by this ({range_text(MIN_COMPRESSION, MAX_COMPRESSION)}; "
        "default 1)",
    )
    parser.add_argument(
        "--copies",
        type=integer(1, MAX_COPIES),
        default=1,
        help=f"overlaid copies of the trace ({range_text(1, MAX_COPIES)}; default 1)",
    )
    parser.add_argument(
        "--apply-delay",
        type=_seconds,
        default=5.0,
        help=f"node agent apply delay, s ({range_text(0, DAY_S)}; default 5)",
    )
    parser.add_argument(
        "--batch-retry-seconds",
        dest="retry",
        type=_seconds,
        default=60.0,
        metavar="SECONDS",
        help="the partitioner's batch retry for planned pods still pending, as its "
        f"--batch-retry-seconds ({range_text(0, DAY_S)}; default 60)",
    )
    deprecated_alias(parser, "--retry", "--batch-retry-seconds", "retry", type=_seconds)
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
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
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
    out = out_folder(args.out, WRITES)  # made now: a bad --out must not lose the runs' results

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
        try:
            out.mkdir(parents=True, exist_ok=True)
            (out / "sweep.json").write_text(json.dumps(doc, indent=2) + "\n")
            plot = plot_sweep(rows, best, out / "sweep.png")
        except OSError as e:  # the table is printed above: say what was not written
            raise BadInput(
                f"--out {args.out}: could not write {', '.join(WRITES)} "
                f"({e.strerror or e}); the results are printed above"
            ) from None
        print(f"wrote {out / 'sweep.json'} and {plot}", file=sys.stderr)
    return 0 if best is not None else 1
