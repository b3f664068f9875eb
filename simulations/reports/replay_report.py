"""Time-replay reports: a comparison table, a Markdown report, JSON, and PNG plots.

Output of :func:`write_replay_report` in a directory:

* ``replay.md`` — the settings, the comparison table (one row per policy, the metrics of
  :mod:`simulations.replay.metrics`), the plots, and notes;
* ``replay.json`` — the same summaries plus the settings, machine-readable;
* ``pending_cdf.png`` — the empirical CDF of pending time per policy (log x axis; a pod never
  scheduled counts with its censored wait);
* ``reconfigurations.png`` — cumulative GPUs reconfigured over time per policy;
* ``allocation.png`` — the allocation step function over time per policy;
* ``layout_changes.json`` — per policy, every GPU layout an applied spec changed (devices
  before and after, the pods waiting then per request) and the changes counted by transition;
  the report tables the most frequent ("What the reconfigurations were").

The folder is made with its parents; a folder or file that cannot be written raises
:class:`ReportWriteError` (a ``ValueError`` naming the folder and the fix), never a bare
``OSError`` (:func:`report_folder`, which the saturation report uses too).

Plots use matplotlib's Agg backend (no display needed).  The saturation protocol's report
(allocation against arrived demand) is :func:`simulations.bench_saturation.write_report`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from simulations.replay.metrics import ReplayResult, ReplaySummary, change_log, summarize

__all__ = [
    "COLUMNS",
    "REPLAY_FILES",
    "ReportWriteError",
    "format_table",
    "markdown_table",
    "plot_allocation",
    "plot_pending_cdf",
    "plot_reconfigurations",
    "replay_warnings",
    "report_folder",
    "write_replay_report",
]

COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("policy", "policy", "{}"),
    ("pods", "pods", "{}"),
    ("pending_p50_s", "p50 s", "{:.0f}"),
    ("pending_p95_s", "p95 s", "{:.0f}"),
    ("pending_p99_s", "p99 s", "{:.0f}"),
    ("never_scheduled", "never", "{}"),
    ("reconfigurations_per_hour", "reconf/h", "{:.2f}"),
    ("pods_disrupted", "disrupted", "{}"),
    ("plans", "plans", "{}"),
    ("planner_ms_p50", "plan ms p50", "{:.1f}"),
    ("planner_ms_p95", "plan ms p95", "{:.1f}"),
    ("allocation_mean", "alloc mean", "{:.3f}"),
)
"""(summary field, column header, format) of the comparison table."""


REPLAY_FILES: tuple[str, ...] = (
    "replay.md",
    "replay.json",
    "pending_cdf.png",
    "reconfigurations.png",
    "allocation.png",
    "layout_changes.json",
)
"""Every file :func:`write_replay_report` writes, report first."""


class ReportWriteError(ValueError):
    """A report could not be written into its folder (the message names it and the fix)."""


@contextmanager
def report_folder(out_dir: str | Path) -> Iterator[Path]:
    """``out_dir`` as a :class:`~pathlib.Path`, made with its parents; an ``OSError`` making it
    or writing in the ``with`` block becomes a :class:`ReportWriteError` naming the folder
    (e.g. a path under a regular file, or a folder that cannot be created)."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        yield out
    except OSError as e:
        what = f" ({e.filename})" if e.filename and str(e.filename) != str(out) else ""
        raise ReportWriteError(
            f"cannot write the report into {out}{what}: {e.strerror or e}; give a folder "
            "that can be created and written"
        ) from None


def _cell(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def _rows(summaries: Sequence[ReplaySummary]) -> list[list[str]]:
    return [[_cell(getattr(s, f), fmt) for f, _, fmt in COLUMNS] for s in summaries]


def format_table(summaries: Sequence[ReplaySummary]) -> str:
    """A plain-text table for the terminal."""
    header = [h for _, h, _ in COLUMNS]
    rows = _rows(summaries)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in [header, *rows]
    )


def markdown_table(summaries: Sequence[ReplaySummary]) -> str:
    header = [h for _, h, _ in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in _rows(summaries)]
    return "\n".join(lines)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(plt: Any, fig: Any, ax: Any, path: Path) -> Path:
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_pending_cdf(results: Sequence[ReplayResult], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        values = sorted(r.pending_times())
        if not values:
            continue
        n = len(values)
        xs = [max(v, 0.1) for v in values]
        ax.step(xs, [(i + 1) / n for i in range(n)], where="post", label=r.policy)
    ax.set_xscale("log")
    ax.set_xlabel("pending time (s, log; 0 drawn at 0.1 s)")
    ax.set_ylabel("fraction of pods")
    ax.set_title("Pending time CDF")
    return _finish(plt, fig, ax, path)


def plot_reconfigurations(results: Sequence[ReplayResult], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        xs, ys, total = [r.start], [0], 0
        for t, n in r.reconfigurations:
            total += n
            xs.append(t)
            ys.append(total)
        xs.append(r.end)
        ys.append(total)
        ax.step([(x - r.start) / 3600 for x in xs], ys, where="post", label=r.policy)
    ax.set_xlabel("time (h since the first arrival)")
    ax.set_ylabel("GPUs reconfigured (cumulative)")
    ax.set_title("Reconfigurations over time")
    return _finish(plt, fig, ax, path)


def plot_allocation(results: Sequence[ReplayResult], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        pts = [*r.allocation, (r.end, r.allocation[-1][1] if r.allocation else 0.0)]
        ax.step(
            [(t - r.start) / 3600 for t, _ in pts],
            [100 * v for _, v in pts],
            where="post",
            label=r.policy,
            linewidth=0.8,
        )
    ax.set_xlabel("time (h since the first arrival)")
    ax.set_ylabel("allocated (%)")
    ax.set_ylim(0, 105)
    ax.set_title("Allocation over time")
    return _finish(plt, fig, ax, path)


def write_replay_report(
    results: Sequence[ReplayResult],
    out_dir: str | Path,
    title: str = "Time replay",
    context: Mapping[str, Any] | None = None,
    notes: Sequence[str] = (),
) -> Path:
    """Write :data:`REPLAY_FILES` (``replay.md``, ``replay.json``, the three PNGs and
    ``layout_changes.json``) into ``out_dir``; return the .md.

    ``layout_changes.json`` holds, per policy, every GPU layout an applied spec changed with
    the waiting queue then and the changes counted by transition; the report tables the most
    frequent transitions.  Both are empty for results replayed without
    ``ReplaySettings.record_changes`` (:func:`simulations.reports.replay_protocol.run_replay_protocol`
    turns it on when it writes a report).  :class:`ReportWriteError` when ``out_dir`` cannot be
    made or written."""
    with report_folder(out_dir) as out:
        return _write_replay_report(results, out, title, dict(context or {}), notes)


def _write_replay_report(
    results: Sequence[ReplayResult],
    out: Path,
    title: str,
    ctx: dict[str, Any],
    notes: Sequence[str],
) -> Path:
    summaries = [summarize(r) for r in results]
    md_name, json_name, cdf_name, reconf_name, alloc_name, changes_name = REPLAY_FILES
    plots = {
        cdf_name: plot_pending_cdf(results, out / cdf_name),
        reconf_name: plot_reconfigurations(results, out / reconf_name),
        alloc_name: plot_allocation(results, out / alloc_name),
    }
    doc: dict[str, Any] = {"context": ctx, "summaries": [s.as_dict() for s in summaries]}
    warnings = replay_warnings(results)
    if warnings:
        doc["warnings"] = warnings
    (out / json_name).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    lines = [f"# {title}", ""]
    if ctx:
        lines += [f"- **{k}**: {v}" for k, v in ctx.items()]
        lines.append("")
    if warnings:
        lines += ["## Warnings", "", *(f"- **warning**: {w}" for w in warnings), ""]
    lines += [markdown_table(summaries), ""]
    lines += [
        "Pending times are nearest-rank percentiles over all GPU pods; a pod never scheduled "
        "counts with the time it waited (a lower bound). Reconfigurations per hour count GPUs "
        "changed by applied specs per replayed hour. Disruptions must be 0.",
        "",
    ]
    for name in plots:
        lines += [f"![{name[:-4]}]({name})", ""]
    logs = [{"policy": r.policy, **change_log(r)} for r in results]
    (out / changes_name).write_text(json.dumps({"policies": logs}, indent=1) + "\n")
    counted = [(log["policy"], log["transitions"]) for log in logs]
    if any(counts for _, counts in counted):
        lines += _transition_lines(counted, changes_name)
    all_notes = [*notes, *(n for r in results for n in r.notes)]
    errors = [f"{r.policy}: {e}" for r in results for e in r.planner_errors[:3]]
    if all_notes or errors:
        lines += ["## Notes", "", *(f"- {n}" for n in [*all_notes, *errors]), ""]
    md = out / md_name
    md.write_text("\n".join(lines))
    return md


def replay_warnings(results: Sequence[ReplayResult]) -> list[str]:
    """The results' :attr:`~simulations.replay.metrics.ReplayResult.warnings`, each once (a
    warning about the workload is the same for every policy), in order."""
    return list(dict.fromkeys(w for r in results for w in r.warnings))


TOP_TRANSITIONS = 6
"""Transitions per policy the report tables (the JSON holds them all)."""


def _transition_lines(counted: Sequence[tuple[str, Mapping[str, int]]], name: str) -> list[str]:
    """The report's "What the reconfigurations were" section: per policy, its most frequent
    layout transitions (GPU layout before -> after, positions dropped) and their share."""
    lines = [
        "## What the reconfigurations were",
        "",
        "GPUs changed by applied specs, by layout before -> after (`-`: no instance), the "
        f"{TOP_TRANSITIONS} most frequent per policy; every change, with the pods waiting then, "
        f"is in [{name}]({name}).",
        "",
        "| policy | transition | GPUs | share |",
        "|---|---|---|---|",
    ]
    for policy, counts in counted:
        total = sum(counts.values())
        for key, n in list(counts.items())[:TOP_TRANSITIONS]:
            lines.append(f"| {policy} | {key} | {n} | {100 * n / total:.0f} % |")
    lines.append("")
    return lines
