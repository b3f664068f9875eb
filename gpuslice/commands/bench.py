"""``gpuslice bench planner`` and ``gpuslice bench controller``: the benchmarks.

``planner`` (:mod:`simulations.bench_planner`) times the CP-SAT planner against the greedy
baseline; ``controller`` (:mod:`simulations.bench_controller`) times the partitioner's index
build and decision step on a large cluster (memory, idle cycle, snapshot build).

Output of ``planner`` (``-o``, :mod:`gpuslice.output`): one table row per cluster size, as in
the README -- wall time p50 / p99 of CP-SAT and of the greedy baseline, pods placed per
instance, eligible pods left unplaced and weighted churn (sums over the instances), CP-SAT's
solver statuses and whether CP-SAT placed at least the greedy's priority-weighted pods on every
instance.
``-o wide`` adds CPU time and the calls over the time limit; ``-o json`` / ``-o yaml`` print the
whole result document (per-plan times, churn parts, gaps, the machine's load).
``--out DIR`` also writes that document to ``DIR/planner.json``.  Progress (one line per
instance) goes to stderr unless ``--quiet``.

Output of ``controller``: one table row per figure (index build, memory, first cycle, the two
kinds of idle cycle, snapshot build) with its target and pass/fail where issue 11 sets one;
``-o json`` / ``-o yaml`` print the whole document; ``--out DIR`` writes
``DIR/controller.json``.  The planner's options (``--sizes`` ...) and the controller's
(``--nodes``, ``--pods``, ``--pending``, ``--cycles``, ``--snapshot-repeats``) are each read by
their own target only; ``--seed`` is shared.  Every option is checked before either target
runs, whichever target it is for (a bad ``--time-limit`` is refused by ``bench controller``
too), and ``--out`` is made before the benchmark starts (exit 2 when it cannot be): a typo
there must not lose the run at its end.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuslice.cli import BadInput
from gpuslice.options import out_folder
from gpuslice.output import Column, add_output_argument, emit, render_table

HELP = (
    "run a benchmark: 'planner' compares the CP-SAT planner with the greedy baseline; "
    "'controller' times the partitioner's index and decision step on a large cluster"
)
REPORT_FILE = "planner.json"
"""The file ``--out DIR`` gets from ``bench planner``."""
REPORT_FILES = {"planner": REPORT_FILE, "controller": "controller.json"}
"""The file ``--out DIR`` gets, per target."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from simulations import bench_controller, bench_planner

    parser.add_argument("target", choices=list(REPORT_FILES), help="what to benchmark")
    bench_planner.add_arguments(parser)
    bench_controller.add_arguments(parser, seed=False)
    parser.add_argument(
        "--out",
        metavar="DIR",
        help=f"also write the result document to DIR/{REPORT_FILE} (bench planner) or "
        f"DIR/{REPORT_FILES['controller']} (bench controller); DIR is created",
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
        lambda r: (
            f"{', '.join(map(str, r['cpsat']['placed']))} vs "
            f"{', '.join(map(str, r['greedy']['placed']))}"
        ),
    ),
    Column(
        "eligible unplaced, CP-SAT vs greedy",
        lambda r: (
            f"{sum(r['cpsat']['unplaced_eligible'])} vs {sum(r['greedy']['unplaced_eligible'])}"
        ),
    ),
    Column(
        "weighted churn, CP-SAT vs greedy",
        lambda r: (
            f"{sum(r['cpsat']['churn_weighted']):,} vs {sum(r['greedy']['churn_weighted']):,}"
        ),
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


def _target(out: str | None, name: str = REPORT_FILE) -> Path | None:
    """The file ``--out`` means: ``DIR/<name>``; a value ending in ``.json`` that is not
    a folder is the first releases' ``--out FILE``, kept with a note.  Its folder is made now,
    before the benchmark runs (:func:`gpuslice.options.out_folder`); :class:`BadInput` when it
    cannot be, or the file could not be written."""
    if not out:
        return None
    path = Path(out)
    if path.suffix == ".json" and not path.is_dir():
        print(f"gpuslice bench: note: --out FILE is deprecated; give a folder, which gets "
              f"{name}", file=sys.stderr)  # fmt: skip
        folder = out_folder(str(path.parent), [path.name], given=out)
        assert folder is not None
        return folder / path.name
    folder = out_folder(out, [name])
    assert folder is not None
    return folder / name


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f} ms"


def _verdict(doc: dict[str, Any], name: str) -> tuple[str, str]:
    t = doc["targets"][name]
    unit = " MiB" if name.endswith("_mib") else ""
    limit = f"<= {t['limit']:g}{unit}" if unit else f"<= {_ms(t['limit'])}"
    return limit, "pass" if t["pass"] else "FAIL"


def controller_rows(doc: dict[str, Any]) -> list[dict[str, str]]:
    """The rows of the ``bench controller`` table (one per figure)."""
    idx, mem, cyc, snap = doc["index"], doc["memory"], doc["cycles"], doc["snapshot"]
    turn, heap = doc["turnover"], doc["heap"]

    def times(s: dict[str, float]) -> str:
        return f"{_ms(s['p50'])} / {_ms(s['p99'])}"

    def mib(v: float | None) -> str:
        return "n/a" if v is None else f"{v:g} MiB"

    idle_limit, idle_ok = _verdict(doc, "idle_cycle_p99_s")
    snap_limit, _ = _verdict(doc, "snapshot_build_s")
    mem_limit, mem_ok = _verdict(doc, "resident_memory_mib")
    return [
        {"figure": "index build (all objects as ADDED events)",
         "value": f"{idx['build_s']:.2f} s ({idx['apply_us_per_object']:g} us/object)",
         "target": "", "result": ""},
        {"figure": "resident memory after build, after cycles",
         "value": f"{mib(mem['index_mib'])}, {mib(mem['steady_mib'])}",
         "target": mem_limit, "result": mem_ok},
        {"figure": "first cycle (computes, caches eligibility)", "value": _ms(cyc["first_s"]),
         "target": "", "result": ""},
        {"figure": "idle cycle, window open: p50 / p99",
         "value": times(cyc["idle_window_open_s"]), "target": "", "result": ""},
        {"figure": "idle cycle, after a plan: p50 / p99",
         "value": times(cyc["idle_after_plan_s"]), "target": "", "result": ""},
        {"figure": "idle cycle, all: p50 / p99", "value": times(cyc["idle_all_s"]),
         "target": f"p99 {idle_limit}", "result": idle_ok},
        {"figure": f"snapshot build ({snap['pods']} pods, {snap['nodes']} nodes): p50 / p99",
         "value": times(snap["build_s"]), "target": f"p99 {snap_limit}",
         "result": _within(snap["build_s"]["p99"], doc, "snapshot_build_s")},
        {"figure": "snapshot build, every pod updated once: p50 / p99",
         "value": times(turn["build_s"]), "target": f"p99 {snap_limit}",
         "result": _within(turn["build_s"]["p99"], doc, "snapshot_build_s")},
        {"figure": f"heap reclaim, every {heap['reclaim_every_s']:g} s ({heap['policy']})",
         "value": "n/a" if heap["reclaim_s"] is None
         else f"{_ms(heap['reclaim_s'])}, {heap['reclaim_unreachable']} objects freed from frozen cycles",
         "target": "", "result": ""},
    ]  # fmt: skip


def _within(value: float, doc: dict[str, Any], name: str) -> str:
    return "pass" if value <= doc["targets"][name]["limit"] else "FAIL"


CONTROLLER_COLUMNS = (
    Column("figure", "figure"),
    Column("value", "value"),
    Column("target", "target"),
    Column("result", "result"),
)


def render_controller(doc: dict[str, Any], wide: bool = False, width: int | None = None) -> str:
    """The README's table of a :func:`simulations.bench_controller.run_benchmark` result."""
    load = doc["machine"]["loadavg_start"]
    head = (
        f"controller benchmark: {doc['nodes']} nodes x {doc['gpus_per_node']} "
        f"{doc['gpu_model']}, {doc['pods']} pods ({doc['pending']} pending), seed "
        f"{doc['seed']}, {doc['machine']['cpus']} CPU(s), load "
        f"{'n/a' if load is None else ' '.join(map(str, load))}"
    )
    table = render_table(CONTROLLER_COLUMNS, controller_rows(doc), wide=wide, width=width)
    return f"{head}\n{table}"


def _progress(args: argparse.Namespace) -> Callable[[str], None]:
    if args.quiet:
        return lambda _: None
    return lambda line: print(line, file=sys.stderr, flush=True)


def _write(doc: dict[str, Any], target: Path | None) -> None:
    """Write the document to ``target`` (after it was printed: a failure loses nothing)."""
    if target is not None:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(doc, indent=2) + "\n")
        except OSError as e:
            raise BadInput(
                f"--out: could not write {target} ({e.strerror or e}); the results are "
                "printed above"
            ) from None
        print(f"wrote {target}", file=sys.stderr)


def run_controller(args: argparse.Namespace) -> int:
    from simulations import bench_controller, bench_planner

    try:
        bench_planner.check_args(args)  # the options every target accepts, checked alike
        bench_controller.check_args(args)
    except ValueError as e:
        raise BadInput(str(e)) from e
    target = _target(args.out, REPORT_FILES["controller"])
    doc = bench_controller.run_args(args, _progress(args))
    emit(doc, args.output, lambda wide, width: render_controller(doc, wide, width))
    _write(doc, target)
    return 0


def run(args: argparse.Namespace) -> int:
    from simulations import bench_planner

    if args.target == "controller":
        return run_controller(args)
    try:
        instances = bench_planner.check_args(args)
    except ValueError as e:
        raise BadInput(str(e)) from e
    target = _target(args.out)
    doc = bench_planner.run_args(args, instances, _progress(args))
    emit(doc, args.output, lambda wide, width: render_text(doc, wide, width))
    _write(doc, target)
    return 0
