"""Saturation benchmark and report: BestFit vs FGD vs gpuslice on openb traces (JSON to stdout).

Usage::

    python -m simulations.bench_saturation                      # default trace, seeds 42-51
    python -m simulations.bench_saturation --trace all --jobs 2 --out bench.json
    python -m simulations.bench_saturation --trace gpuspec10 --seeds 42-46 --policies fgd,gpuslice
    python -m simulations.bench_saturation --batch 8 --policies gpuslice

It runs :func:`simulations.saturation.runner.run_policy` for every (trace, policy, seed) on the
openb cluster (``--cluster`` takes a YAML file too) and prints one JSON document: per trace and
policy its protocol, the mean and standard deviation over seeds of alloc@130, alloc@100,
fragmentation amount and ratio at 100 %, idle GPUs, failed pods and run time, the per-seed
alloc@130 values, for the ``gpuslice`` row the planner's time per call and per arrival, and
the published FGD figures for the default trace.  The rows (:data:`simulations.saturation.runner.ROWS`)
belong to two protocols: ``bestfit``, ``fgd`` and ``fgd-waste`` to the FGD paper's, where the
policy places every pod; ``gpuslice`` (:func:`planner.plan`, the production decision) and
``mps:bestfit``, ``mps:fgd``, ``mps:fgd-waste`` to the partitioner protocol, where
kube-scheduler places the CPU-only pods and GPU pods get MPS slices
(:mod:`simulations.saturation.runner`); ``--cpu-scheduler`` says who places those CPU-only pods
(FGD's BestFit by default; ``least-allocated`` is kube-scheduler's default profile,
``most-allocated`` its bin-packing one).  ``--jobs N`` runs N processes.  The openb directory
comes from ``--openb-dir``, ``$GPUSLICE_OPENB_DIR`` or ``../shared/traces/openb``.

Report helpers (shared with ``gpuslice simulate``)
--------------------------------------------------
Results are grouped by (policy, batch).  :func:`aggregate` gives the mean and sample standard
deviation over seeds of each headline metric; :func:`format_table` a fixed-width table;
:func:`write_report` writes ``report.md`` (table and setup), ``allocation.png`` (mean GPU
allocation vs arrived demand per policy; matplotlib, Agg backend) and ``results.json``
(summaries, per-seed rows and the binned curves).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from simulations.inputs.cluster import load_cluster
from simulations.inputs.openb import OPENB_TRACES, load_openb_pods, openb_dir, resolve_trace
from simulations.reports.out_file import out_file_error
from simulations.reports.replay_report import report_folder
from simulations.saturation.partitioned import CpuScheduler
from simulations.saturation.protocol import SaturationResult
from simulations.saturation.runner import ROWS, cpu_scheduler_of, protocol_of, run_policy

__all__ = ["PUBLISHED", "aggregate", "format_table", "main", "parse_seeds", "write_report"]

PUBLISHED: Mapping[str, Mapping[str, float]] = {
    "bestfit": {
        "alloc@130": 93.076,
        "alloc@100": 92.862,
        "frag_amount@100": 7.055,
        "frag_ratio@100": 98.84,
    },
    "fgd": {
        "alloc@130": 95.391,
        "alloc@100": 95.227,
        "frag_amount@100": 4.729,
        "frag_ratio@100": 99.07,
    },
}
"""FGD paper, default trace, openb cluster, mean of seeds 42-51 (fgd.md §6)."""

_METRICS = (
    ("alloc@130", "alloc", 130),
    ("alloc@100", "alloc", 100),
    ("frag_amount@100", "frag_amount", 100),
    ("frag_ratio@100", "frag_ratio", 100),
)


def _label(r: SaturationResult) -> str:
    label = r.policy if r.batch == 1 else f"{r.policy} (k={r.batch})"
    cpu = r.extra.get("cpu_scheduler", CpuScheduler.BESTFIT.value)
    return label if cpu == CpuScheduler.BESTFIT.value else f"{label} [cpu {cpu}]"


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def aggregate(results: Sequence[SaturationResult]) -> dict[str, dict[str, Any]]:
    """Per policy label: seeds, mean/sd of each headline metric, per-seed alloc@130."""
    groups: dict[str, list[SaturationResult]] = {}
    for r in results:
        groups.setdefault(_label(r), []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for label, rs in groups.items():
        row: dict[str, Any] = {
            "policy": rs[0].policy,
            "protocol": _protocol(rs[0]),
            "batch": rs[0].batch,
            "seeds": [r.seed for r in rs],
        }
        if "cpu_scheduler" in rs[0].extra:
            row["cpu_scheduler"] = rs[0].extra["cpu_scheduler"]
        for name, series, pct in _METRICS:
            vals = [v for r in rs if (v := r.at(series, pct)) is not None]
            if vals:
                mean, sd = _mean_sd(vals)
                row[name] = round(mean, 3)
                row[f"{name}_sd"] = round(sd, 3)
        row["final_alloc"] = round(statistics.fmean(r.final_alloc_pct for r in rs), 3)
        row["unallocated_gpus"] = round(statistics.fmean(r.unallocated_gpus for r in rs), 2)
        row["failed_pods"] = round(statistics.fmean(r.failed for r in rs), 1)
        row["pods"] = round(statistics.fmean(r.pods for r in rs), 1)
        row["runtime_s"] = round(statistics.fmean(r.runtime_s for r in rs), 3)
        row["per_seed_alloc@130"] = [r.at("alloc", 130) for r in rs]
        planned = [r for r in rs if r.extra.get("planner_calls")]
        if planned:
            row["planner_ms_per_call_p50"] = _ms(r.extra["planner_s_p50"] for r in planned)
            row["planner_ms_per_call_p95"] = _ms(r.extra["planner_s_p95"] for r in planned)
            row["planner_ms_per_arrival"] = _ms(
                r.extra["planner_s_total"] / max(1, r.pods) for r in planned
            )
        out[label] = row
    return out


def _protocol(r: SaturationResult) -> str:
    known = r.extra.get("protocol")
    return str(known) if known else protocol_of(r.policy)


def _ms(seconds: Iterable[float | None]) -> float | None:
    """Mean over seeds, in milliseconds (None when no seed has the figure)."""
    vals = [1000.0 * v for v in seconds if v is not None]
    return round(statistics.fmean(vals), 2) if vals else None


def _cell(row: Mapping[str, Any], key: str, width: int) -> str:
    v = row.get(key)
    return f"{'n/a':>{width}}" if v is None else f"{v:>{width}.2f}"


def format_table(summary: Mapping[str, Mapping[str, Any]]) -> str:
    """A fixed-width comparison table (one line per policy; n/a where a bin had no event)."""
    head = (
        f"{'policy':<22}{'protocol':<13}{'alloc@130 %':>13}{'alloc@100 %':>13}{'final %':>9}{'frag amt@100':>14}"
        f"{'frag ratio@100':>16}{'idle GPUs':>11}{'failed':>9}{'s/run':>8}"
    )
    lines = [head, "-" * len(head)]
    for label, r in summary.items():
        a130 = (
            "n/a"
            if r.get("alloc@130") is None
            else f"{r['alloc@130']:.2f}±{r.get('alloc@130_sd', 0.0):.2f}"
        )
        lines.append(
            f"{label:<22}{r.get('protocol', ''):<13}{a130:>13}{_cell(r, 'alloc@100', 13)}{_cell(r, 'final_alloc', 9)}"
            f"{_cell(r, 'frag_amount@100', 14)}{_cell(r, 'frag_ratio@100', 16)}"
            f"{r['unallocated_gpus']:>11.1f}{r['failed_pods']:>9.0f}{r['runtime_s']:>8.2f}"
        )
    return "\n".join(lines)


def _mean_curve(rs: Sequence[SaturationResult]) -> tuple[list[int], list[float]]:
    xs: list[int] = []
    ys: list[float] = []
    for a in range(len(rs[0].curve.alloc)):
        vals = [v for r in rs if (v := r.curve.alloc[a]) is not None]
        if vals:
            xs.append(a)
            ys.append(statistics.fmean(vals))
    return xs, ys


def write_plot(results: Sequence[SaturationResult], path: Path, title: str) -> None:
    """Mean GPU allocation vs arrived demand per policy: full range and a zoom on 80-130 %."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[SaturationResult]] = {}
    for r in results:
        groups.setdefault(_label(r), []).append(r)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, (lo, hi) in zip(axes, ((0, 130), (80, 130)), strict=True):
        low_y = 100.0
        for label, rs in groups.items():
            xs, ys = _mean_curve(rs)
            ax.plot(xs, ys, label=label)
            low_y = min([low_y, *(y for x, y in zip(xs, ys, strict=True) if x >= lo)])
        ax.plot(
            [0, 100],
            [0, 100],
            color="grey",
            linestyle=":",
            linewidth=0.8,
            label="demand = capacity",
        )
        ax.set_xlim(lo, hi)
        if lo > 0:
            ax.set_ylim(max(0.0, low_y - 1.0), 100.5)
        ax.set_xlabel("arrived GPU demand (% of capacity)")
        ax.set_ylabel("GPU allocation (% of capacity)")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(
    out_dir: Path, results: Sequence[SaturationResult], setup: Mapping[str, Any]
) -> list[Path]:
    """Write ``report.md``, ``allocation.png`` and ``results.json`` into ``out_dir`` (made with
    its parents); :class:`~simulations.reports.replay_report.ReportWriteError` naming it when
    it cannot be made or written."""
    with report_folder(out_dir) as out:
        return _write_report(out, results, setup)


def _write_report(
    out_dir: Path, results: Sequence[SaturationResult], setup: Mapping[str, Any]
) -> list[Path]:
    summary = aggregate(results)
    png = out_dir / "allocation.png"
    write_plot(results, png, str(setup.get("title", "Saturation protocol")))
    doc = {
        "setup": dict(setup),
        "summary": summary,
        "runs": [r.summary() for r in results],
        "curves": [
            {
                "policy": r.policy,
                "batch": r.batch,
                "seed": r.seed,
                "alloc": list(r.curve.alloc),
                "frag_amount": list(r.curve.frag_amount),
                "frag_ratio": list(r.curve.frag_ratio),
            }
            for r in results
        ],
    }
    js = out_dir / "results.json"
    js.write_text(json.dumps(doc, indent=1))
    md = out_dir / "report.md"
    setup_lines = "\n".join(f"- {k}: {v}" for k, v in setup.items())
    md.write_text(
        "# gpuslice simulate — saturation protocol\n\n"
        f"{setup_lines}\n\n"
        "Means over seeds (± sample standard deviation). alloc@X: GPU allocation (% of capacity)\n"
        "when the arrived demand is X % of capacity (n/a: no event landed near X); final: at the\n"
        "end of the run; fragmentation per FGD (amount: % of capacity; ratio: % of idle GPU);\n"
        "idle GPUs and failed pods at the end of the run.\n\n"
        "```\n" + format_table(summary) + "\n```\n\n"
        "![GPU allocation vs arrived demand](allocation.png)\n\n"
        "Per-seed values and binned curves: `results.json`.\n"
    )
    return [md, png, js]


def parse_traces(text: str) -> list[str]:
    """``all`` -> every openb trace; else the comma-separated names."""
    return list(OPENB_TRACES) if text == "all" else [t for t in text.split(",") if t]


def parse_choices(text: str, allowed: Sequence[str], what: str) -> list[str]:
    """Comma-separated names, each one of ``allowed`` (else ValueError naming ``what``)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; choose from {', '.join(allowed)}")
    return names


def parse_seeds(text: str, what: str = "seeds") -> list[int]:
    """``42-51`` or ``42,43,50`` (or a mix) -> list of seeds (or case numbers: ``what``).

    A range that runs backwards (``51-42``) is refused, not read as empty."""
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            if sep:
                first, last = int(lo), int(hi)
            else:
                first = last = int(part)
        except ValueError:
            raise ValueError(f"{what} {text!r}: use '42-51' or '42,43,44'") from None
        if last < first:
            raise ValueError(f"{what} {text!r}: range {part!r} runs backwards")
        seeds.extend(range(first, last + 1))
    if not seeds:
        raise ValueError(f"{what} {text!r}: none given")
    return seeds


def _run_task(task: tuple[str, str, str, int, int, str | None, str]) -> SaturationResult:
    """One (trace, policy, seed) run (in a worker process when ``--jobs`` > 1)."""
    cluster_spec, trace, policy, seed, batch, directory, cpu_scheduler = task
    cluster = load_cluster(cluster_spec, directory)
    workload = load_openb_pods(resolve_trace(trace, directory))
    r = run_policy(cluster, workload, policy, seed, batch=batch, cpu_scheduler=cpu_scheduler)
    r.extra.pop("plan_s_list", None)
    r.extra.pop("placed_flags", None)
    print(
        f"{trace} {r.policy} k={batch} seed {seed}: alloc@130 {r.at('alloc', 130)} "
        f"({r.runtime_s:.1f} s)",
        file=sys.stderr,
        flush=True,
    )
    return r


def run_grid(
    cluster_spec: str,
    traces: Sequence[str],
    policies: Sequence[str],
    seeds: Sequence[int],
    batch: int,
    directory: str | None,
    jobs: int = 1,
    cpu_scheduler: str = CpuScheduler.BESTFIT.value,
) -> dict[str, Any]:
    """Run every (trace, policy, seed), ``jobs`` at a time; return the JSON-ready document.
    ``cpu_scheduler`` places the partitioner protocol's CPU-only pods."""
    cluster = load_cluster(cluster_spec, directory)
    doc: dict[str, Any] = {
        "protocol": "saturation",
        "cluster": cluster.summary(),
        "seeds": list(seeds),
        "batch": batch,
        "cpu_scheduler": cpu_scheduler,
        "date": time.strftime("%Y-%m-%d"),
        "traces": {},
    }
    tasks = [
        (cluster_spec, trace, policy, seed, batch, directory, cpu_scheduler)
        for trace in traces
        for policy in policies
        for seed in seeds
    ]
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(_run_task, tasks))
    else:
        results = [_run_task(t) for t in tasks]
    for trace in traces:
        workload = load_openb_pods(resolve_trace(trace, directory))
        mine = [r for r, t in zip(results, tasks, strict=True) if t[1] == trace]
        entry: dict[str, Any] = {"pods": len(workload), "policies": aggregate(mine)}
        if trace == "default" and cluster_spec == "openb":
            entry["published"] = PUBLISHED
        doc["traces"][trace] = entry
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m simulations.bench_saturation", description=__doc__.splitlines()[0]
    )
    ap.add_argument(
        "--trace",
        default="default",
        help="openb trace name(s), comma-separated, or 'all' (default: default)",
    )
    ap.add_argument(
        "--cluster", default="openb", help="'openb' or a cluster YAML file (default: openb)"
    )
    ap.add_argument("--seeds", default="42-51", help="seeds, e.g. 42-51 or 42,43 (default: 42-51)")
    ap.add_argument(
        "--policies",
        default=",".join(ROWS),
        help=f"comma-separated (default: {','.join(ROWS)})",
    )
    ap.add_argument("--batch", type=int, default=1, help="arrivals per batch k (default: 1)")
    ap.add_argument(
        "--cpu-scheduler",
        default=CpuScheduler.BESTFIT.value,
        help="who places the partitioner protocol's CPU-only pods: "
        + ", ".join(c.value for c in CpuScheduler)
        + " (default: bestfit, FGD's BestFit)",
    )
    ap.add_argument("--jobs", type=int, default=1, help="processes (default: 1)")
    ap.add_argument("--openb-dir", default=None, help="folder with the openb CSVs")
    ap.add_argument("--out", default=None, help="also write the JSON to this file")
    args = ap.parse_args(argv)
    try:
        seeds = parse_seeds(args.seeds)
        traces = parse_traces(args.trace)
        policies = parse_choices(args.policies, list(ROWS), "policies")
        if args.batch < 1:
            raise ValueError("--batch must be >= 1")
        cpu = cpu_scheduler_of(args.cpu_scheduler)
        if cpu is not CpuScheduler.BESTFIT:
            own = [p for p in policies if protocol_of(p) == "scheduler"]
            if own:
                raise ValueError(
                    f"--cpu-scheduler {cpu.value}: rows {', '.join(own)} place every pod "
                    "themselves (the FGD paper's protocol); pass partitioner-protocol rows "
                    "only (gpuslice, mps:*)"
                )
        if args.jobs < 1:
            raise ValueError("--jobs must be >= 1")
        if problem := out_file_error("--out", args.out):
            raise ValueError(problem)
        if args.cluster == "openb":
            openb_dir(args.openb_dir)  # fail early with the fix named
        doc = run_grid(
            args.cluster,
            traces,
            policies,
            seeds,
            args.batch,
            args.openb_dir,
            args.jobs,
            cpu.value,
        )
    except ValueError as e:
        print(f"bench_saturation: error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
