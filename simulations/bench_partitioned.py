"""Partitioned-mode saturation benchmark: MIG (CP-SAT, greedy, best static, upper bound), MPS,
hybrid and the GPU-share policies on the openb traces (one JSON document on stdout).

Usage::

    python -m simulations.bench_partitioned                          # default trace, seeds 42-51
    python -m simulations.bench_partitioned --trace all --jobs 2 --out results.json
    python -m simulations.bench_partitioned --rows mig-cpsat,mig-greedy --seeds 42-44 --batch 4

Rows (``--rows``, comma-separated; default: all)
------------------------------------------------
``mig-cpsat`` / ``mig-greedy``
    :func:`simulations.saturation.partitioned.run_planned` on MIG nodes, mapping
    ``mig-compute``, ``planner.plan`` with policy ``cpsat`` / ``greedy``.
``mig-static``
    :func:`~simulations.saturation.partitioned.best_static_run`: the best static layout mix in
    hindsight per seed (its name and every candidate's alloc@130 are in ``per_seed_extra``).
``mig-bound``
    :func:`~simulations.saturation.partitioned.upper_bound_run`: the MIG upper bound (the most
    GPU-milli valid layouts can hold for the arrived pods; see the module's docstring).
``mps``
    ``run_planned`` on MPS nodes, mapping ``mps-memory``, policy ``cpsat``.
``hybrid``
    ``run_planned`` on hybrid nodes with mapping ``hybrid-threshold:<--hybrid-threshold>``,
    once :func:`~simulations.saturation.partitioned.hybrid_support` finds that the planner
    places MPS requests on hybrid nodes; until then the row reports ``unsupported`` and why.
``mps:bestfit``, ``mps:fgd``, ``mps:fgd-waste``
    The GPU-share rules on the MPS row's cluster, mapping and CPU-only placement
    (:func:`simulations.saturation.mps_rules.run_rule`): what BestFit, FGD and the what-if
    ``fgd-waste`` rule pack where, as for gpuslice, kube-scheduler places the CPU-only pods.
``share:bestfit``, ``share:fgd``, ``share:fgd-waste``
    The GPU-share protocol (:func:`simulations.saturation.protocol.run_saturation`) on the original
    openb cluster (its own GPU models), as :mod:`simulations.bench_saturation` runs it: the
    policy places every pod, CPU-only pods too.

Output: per trace and row, the mean and sample standard deviation over seeds of alloc@130, the
per-seed values, failed pods (mean and per seed), the planner's wall time per arrival batch
(p50 / p95 over every batch of every seed that called it) and the mean run time per seed;
then, per trace, the issue-13 target checks.  Progress lines go to stderr.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import numpy as np

from planner.settings import Policy
from planner.snapshot import Mode
from simulations.bench_saturation import parse_choices, parse_seeds, parse_traces
from simulations.inputs.cluster import Cluster, load_cluster
from simulations.inputs.openb import load_openb_pods, openb_dir, resolve_trace
from simulations.inputs.workload import Workload
from simulations.reports.out_file import out_file_error
from simulations.saturation.mps_rules import run_rule
from simulations.saturation.partitioned import (
    DEFAULT_NEIGHBOURHOOD_GPUS,
    GPU_MODEL,
    best_static_run,
    hybrid_support,
    run_planned,
    upper_bound_run,
)
from simulations.saturation.protocol import SaturationResult, run_saturation

__all__ = ["ROWS", "main", "markdown", "run_grid", "summarise", "targets"]

ROWS = (
    "mig-cpsat",
    "mig-greedy",
    "mig-static",
    "mig-bound",
    "mps",
    "hybrid",
    "mps:bestfit",
    "mps:fgd",
    "mps:fgd-waste",
    "share:bestfit",
    "share:fgd",
    "share:fgd-waste",
)
DEFAULT_HYBRID_THRESHOLD = 500


@functools.lru_cache(maxsize=4)
def _cluster(directory: str | None) -> Cluster:
    return load_cluster("openb", directory)


@functools.lru_cache(maxsize=8)
def _workload(trace: str, directory: str | None) -> Workload:
    return load_openb_pods(resolve_trace(trace, directory))


def _one(task: tuple[str, str, int, dict[str, Any]]) -> dict[str, Any]:
    """Run one (trace, row, seed); a run that raises is recorded with its error."""
    try:
        return _run_one(task)
    except Exception as e:  # one broken run must not lose the rest of the grid
        trace, row, seed, _opt = task
        print(f"{trace} {row} seed {seed}: error {e!r}", file=sys.stderr, flush=True)
        return {"trace": trace, "row": row, "seed": seed, "error": f"{type(e).__name__}: {e}"}


def _run_one(task: tuple[str, str, int, dict[str, Any]]) -> dict[str, Any]:
    """Run one (trace, row, seed); return a JSON-ready record (plan times kept raw)."""
    trace, row, seed, opt = task
    cluster = _cluster(opt["openb_dir"])
    workload = _workload(trace, opt["openb_dir"])
    started = time.perf_counter()
    rec: dict[str, Any] = {"trace": trace, "row": row, "seed": seed}
    r: SaturationResult | None = None
    if row == "mig-bound":
        ub = upper_bound_run(cluster, workload, seed)
        rec.update(ub)
        rec["failed"] = None
    elif row == "mig-static":
        r = best_static_run(cluster, workload, seed)
    elif row in ("mig-cpsat", "mig-greedy", "mps", "hybrid"):
        mode, mapping, policy = {
            "mig-cpsat": (Mode.MIG, "mig-compute", Policy.CPSAT),
            "mig-greedy": (Mode.MIG, "mig-compute", Policy.GREEDY),
            "mps": (Mode.MPS, "mps-memory", Policy.CPSAT),
            "hybrid": (Mode.HYBRID, f"hybrid-threshold:{opt['hybrid_threshold']}", Policy.CPSAT),
        }[row]
        if row == "hybrid":
            ok, why = hybrid_support()
            if not ok:
                return {**rec, "unsupported": why}
        r = run_planned(
            cluster,
            workload,
            mode,
            mapping,
            seed,
            policy=policy,
            batch=opt["batch"],
            neighbourhood_gpus=opt["neighbourhood_gpus"],
            label=row,
        )
    elif row.startswith("mps:"):
        r = run_rule(cluster, workload, row.partition(":")[2], seed, batch=opt["batch"])
    elif row.startswith("share:"):
        r = run_saturation(cluster, workload, row.partition(":")[2], seed)
    else:
        raise ValueError(f"unknown row {row!r}")
    if r is not None:
        rec.update(
            {
                "alloc@130": r.at("alloc", 130),
                "final_alloc": round(r.final_alloc_pct, 4),
                "failed": r.failed,
                "pods": r.pods,
                "plan_s": r.extra.get("plan_s_list", []),
                "extra": {
                    k: v for k, v in r.extra.items() if k not in ("plan_s_list", "placed_flags")
                },
            }
        )
    rec["runtime_s"] = round(time.perf_counter() - started, 3)
    print(
        f"{trace} {row} seed {seed}: alloc@130 {rec.get('alloc@130')} ({rec['runtime_s']:.1f} s)",
        file=sys.stderr,
        flush=True,
    )
    return rec


def _ms(values: Sequence[float], q: float) -> float | None:
    return round(1000 * float(np.percentile(np.asarray(values), q)), 2) if values else None


def summarise(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per row: mean/sd of alloc@130 over seeds, per-seed values, failures, planner times."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        rows.setdefault(rec["row"], []).append(rec)
    out: dict[str, dict[str, Any]] = {}
    for row, rs in rows.items():
        rs = sorted(rs, key=lambda r: r["seed"])
        if any("unsupported" in r for r in rs):
            out[row] = {"status": "unsupported", "reason": rs[0].get("unsupported")}
            continue
        errors = {r["seed"]: r["error"] for r in rs if "error" in r}
        rs = [r for r in rs if "error" not in r]
        if not rs:
            out[row] = {"status": "error", "errors": errors}
            continue
        vals = [r["alloc@130"] for r in rs]
        entry: dict[str, Any] = {
            "seeds": [r["seed"] for r in rs],
            "alloc@130": round(statistics.fmean(vals), 3),
            "alloc@130_sd": round(statistics.stdev(vals), 3) if len(vals) > 1 else 0.0,
            "per_seed_alloc@130": vals,
            "runtime_s": round(statistics.fmean(r["runtime_s"] for r in rs), 2),
        }
        if errors:
            entry["errors"] = errors
        if rs[0].get("failed") is not None:
            entry["failed_pods"] = round(statistics.fmean(r["failed"] for r in rs), 1)
            entry["per_seed_failed"] = [r["failed"] for r in rs]
            entry["pods"] = round(statistics.fmean(r["pods"] for r in rs), 1)
        times = [t for r in rs for t in r.get("plan_s", [])]
        if times:
            entry["planner_ms_per_batch_p50"] = _ms(times, 50)
            entry["planner_ms_per_batch_p95"] = _ms(times, 95)
            entry["planner_calls_per_seed"] = round(len(times) / len(rs), 1)
        if row == "mig-bound":
            entry["optimal"] = all(r["optimal"] for r in rs)
        extras = [r.get("extra") for r in rs if r.get("extra")]
        for key in ("slices_used_pct", "fill_pct"):
            got = [e[key] for e in extras if e and key in e]
            if got:
                entry[key] = round(statistics.fmean(got), 3)
        if extras:
            entry["per_seed_extra"] = extras
        out[row] = entry
    return out


def targets(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Issue 13's targets, where the rows they compare ran."""

    def a(row: str) -> float | None:
        r = rows.get(row)
        return None if r is None or "alloc@130" not in r else float(r["alloc@130"])

    out: dict[str, Any] = {}
    cp, gr, ub, hy = a("mig-cpsat"), a("mig-greedy"), a("mig-bound"), a("hybrid")
    if cp is not None and gr is not None:
        out["mig_cpsat_minus_greedy"] = round(cp - gr, 3)
        out["mig_cpsat_ge_greedy_plus_3"] = cp >= gr + 3
    if cp is not None and ub is not None:
        out["mig_cpsat_share_of_bound"] = round(cp / ub, 4) if ub else None
        out["mig_cpsat_ge_97pct_bound"] = cp >= 0.97 * ub
    if cp is not None and "hybrid" in rows:
        if hy is None:
            out["hybrid_ge_cpsat_plus_10"] = "unsupported"
        else:
            out["hybrid_minus_mig_cpsat"] = round(hy - cp, 3)
            out["hybrid_ge_cpsat_plus_10"] = hy >= cp + 10
    return out


def markdown(doc: dict[str, Any]) -> str:
    """A README table of ``doc``: per trace and row, alloc@130 mean ± sd, per-seed values,
    failed pods, planner ms per batch (p50 / p95) and seconds per seed."""
    lines = [
        f"Partitioned saturation, {doc['date']}: seeds {doc['seeds'][0]}-{doc['seeds'][-1]}, "
        f"batch k = {doc['batch']}, planner neighbourhood {doc['neighbourhood_gpus']} GPUs; "
        f"{doc['partitioned_cluster']}.",
        "",
        "| trace | row | alloc@130 % (mean ± sd) | per seed | failed pods | planner ms/batch "
        "p50 / p95 | s/seed |",
        "|---|---|---|---|---|---|---|",
    ]
    for trace, entry in doc["traces"].items():
        for row, r in entry["rows"].items():
            if "alloc@130" not in r:
                lines.append(f"| {trace} | {row} | {r.get('status')} | | | | |")
                continue
            per_seed = ", ".join(f"{v:.2f}" for v in r["per_seed_alloc@130"])
            failed = f"{r['failed_pods']:.0f}" if "failed_pods" in r else ""
            times = (
                f"{r['planner_ms_per_batch_p50']:.1f} / {r['planner_ms_per_batch_p95']:.1f}"
                if "planner_ms_per_batch_p50" in r
                else ""
            )
            lines.append(
                f"| {trace} | {row} | {r['alloc@130']:.2f} ± {r['alloc@130_sd']:.2f} | "
                f"{per_seed} | {failed} | {times} | {r['runtime_s']:.0f} |"
            )
    return "\n".join(lines) + "\n"


def run_grid(
    traces: Sequence[str],
    rows: Sequence[str],
    seeds: Sequence[int],
    *,
    batch: int = 1,
    neighbourhood_gpus: int = DEFAULT_NEIGHBOURHOOD_GPUS,
    hybrid_threshold: int = DEFAULT_HYBRID_THRESHOLD,
    jobs: int = 1,
    directory: str | None = None,
    records_path: Path | None = None,
    recorded_only: bool = False,
) -> dict[str, Any]:
    """Run every (trace, row, seed), ``jobs`` processes at a time; the JSON-ready document.

    With ``records_path``, each finished run is appended there as one JSON line, and runs
    already recorded there (same trace, row, seed and options) are not run again;
    ``recorded_only`` runs nothing else (the document of what is recorded)."""
    started = time.perf_counter()
    opt = {
        "batch": batch,
        "neighbourhood_gpus": neighbourhood_gpus,
        "hybrid_threshold": hybrid_threshold,
        "openb_dir": directory,
    }
    tasks = [(t, r, s, opt) for t in traces for r in rows for s in seeds]
    records: list[dict[str, Any]] = []
    key_opt = {k: v for k, v in opt.items() if k != "openb_dir"}
    if records_path is not None and records_path.exists():
        wanted = {(t, r, s) for t, r, s, _ in tasks}
        for line in records_path.read_text().splitlines():
            rec = json.loads(line)
            key = (rec["trace"], rec["row"], rec["seed"])
            if key in wanted and rec.get("options") == key_opt and "error" not in rec:
                records.append(rec)
                wanted.discard(key)
        tasks = [t for t in tasks if (t[0], t[1], t[2]) in wanted]
    if recorded_only:
        tasks = []

    def done(rec: dict[str, Any]) -> None:
        rec["options"] = key_opt
        records.append(rec)
        if records_path is not None:
            with records_path.open("a") as f:
                f.write(json.dumps(rec) + "\n")

    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            for fut in as_completed([pool.submit(_one, t) for t in tasks]):
                done(fut.result())
    else:
        for t in tasks:
            done(_one(t))
    cluster = _cluster(directory)
    doc: dict[str, Any] = {
        "protocol": "partitioned saturation (simulations.saturation.partitioned)",
        "date": time.strftime("%Y-%m-%d"),
        "cluster": cluster.summary(),
        "partitioned_cluster": (
            f"same nodes, CPU, memory and GPU counts; every GPU an {GPU_MODEL}; openb model "
            "kept as the node label for gpu_spec"
        ),
        "mappings": {
            "mig": "mig-compute",
            "mps": "mps-memory",
            "hybrid": f"hybrid-threshold:{hybrid_threshold}",
        },
        "seeds": list(seeds),
        "batch": batch,
        "neighbourhood_gpus": neighbourhood_gpus,
        "traces": {},
    }
    for trace in traces:
        summary = summarise([r for r in records if r["trace"] == trace])
        doc["traces"][trace] = {
            "pods": len(_workload(trace, directory)),
            "rows": summary,
            "targets": targets(summary),
        }
    doc["wall_s"] = round(time.perf_counter() - started, 1)
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m simulations.bench_partitioned", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--trace", default="default", help="trace(s), comma-separated, or 'all'")
    ap.add_argument("--seeds", default="42-51", help="seeds, e.g. 42-51 or 42,43 (default 42-51)")
    ap.add_argument(
        "--rows", default=",".join(ROWS), help=f"comma-separated from {', '.join(ROWS)}"
    )
    ap.add_argument("--batch", type=int, default=1, help="arrivals per planner call k (default 1)")
    ap.add_argument(
        "--neighbourhood-gpus",
        type=int,
        default=DEFAULT_NEIGHBOURHOOD_GPUS,
        help=f"GPUs the planner sees per batch (default {DEFAULT_NEIGHBOURHOOD_GPUS})",
    )
    ap.add_argument(
        "--hybrid-threshold",
        type=int,
        default=DEFAULT_HYBRID_THRESHOLD,
        help=f"hybrid row: shares >= this milli get a MIG instance (default {DEFAULT_HYBRID_THRESHOLD})",
    )
    ap.add_argument("--jobs", type=int, default=1, help="processes (default 1)")
    ap.add_argument("--openb-dir", default=None, help="folder with the openb CSVs")
    ap.add_argument("--out", default=None, help="also write the JSON to this file")
    ap.add_argument(
        "--recorded-only",
        action="store_true",
        help="run nothing: build the document from the runs in --records",
    )
    ap.add_argument("--markdown", default=None, help="also write a README table to this file")
    ap.add_argument(
        "--records",
        default=None,
        help="append each finished run to this JSON-lines file; runs already there are reused",
    )
    args = ap.parse_args(argv)
    try:
        seeds = parse_seeds(args.seeds)
        traces = parse_traces(args.trace)
        rows = parse_choices(args.rows, list(ROWS), "rows")
        if args.batch < 1 or args.neighbourhood_gpus < 1 or args.jobs < 1:
            raise ValueError("--batch, --neighbourhood-gpus and --jobs must be >= 1")
        if not 1 <= args.hybrid_threshold <= 1000:
            raise ValueError("--hybrid-threshold must be 1..1000 milli")
        for option, path, folders in (
            ("--out", args.out, True),
            ("--markdown", args.markdown, True),
            ("--records", args.records, False),
        ):
            if problem := out_file_error(option, path, make_folders=folders):
                raise ValueError(problem)
        openb_dir(args.openb_dir)
        doc = run_grid(
            traces,
            rows,
            seeds,
            batch=args.batch,
            neighbourhood_gpus=args.neighbourhood_gpus,
            hybrid_threshold=args.hybrid_threshold,
            jobs=args.jobs,
            directory=args.openb_dir,
            records_path=Path(args.records) if args.records else None,
            recorded_only=args.recorded_only,
        )
    except ValueError as e:
        print(f"bench_partitioned: error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(markdown(doc))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
