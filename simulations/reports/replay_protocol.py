"""The time-replay protocol as ``gpuslice simulate --protocol time-replay`` runs it.

:func:`run_replay_protocol` replays one workload on one cluster once per policy
(:func:`simulations.replay.engine.parse_policy` names: ``cpsat``, ``greedy``, ``static:<layout>``;
default :data:`DEFAULT_POLICIES`), returns the comparison table, and with ``out`` writes the
Markdown report, JSON, plots and every layout change
(:func:`simulations.reports.replay_report.write_replay_report`).
:func:`builtin_scenario` is the small MIG scenario used when the user names no trace and no
cluster (:func:`simulations.replay.sweep.default_scenario`).  Errors are :class:`ReplayError` (or
another ``ValueError``) naming the input to fix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from simulations.inputs.cluster import Cluster
from simulations.inputs.workload import Workload
from simulations.replay.engine import ReplayError, ReplaySettings, parse_policy, run_time_replay
from simulations.replay.metrics import ReplayResult, summarize
from simulations.replay.sweep import default_scenario
from simulations.reports.replay_report import format_table, replay_warnings, write_replay_report

__all__ = ["DEFAULT_POLICIES", "builtin_scenario", "run_replay_protocol"]

DEFAULT_POLICIES = "cpsat,greedy,static:balanced"


def builtin_scenario() -> tuple[Workload, Cluster]:
    return default_scenario()


def run_replay_protocol(
    workload: Workload,
    cluster: Cluster,
    policies: str | None = None,
    settings: ReplaySettings = ReplaySettings(),  # noqa: B008 - frozen, never mutated
    out: str | Path | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> tuple[str, list[ReplayResult]]:
    """Replay ``workload`` on ``cluster`` per policy; return the table text and the results."""
    names = [p.strip() for p in (policies or DEFAULT_POLICIES).split(",") if p.strip()]
    if not names:
        raise ReplayError("no replay policy given; use e.g. cpsat,greedy,static:balanced")
    parsed = [parse_policy(n) for n in names]
    if out is not None:  # the report says what the reconfigurations were
        settings = replace(settings, record_changes=True)
    results: list[ReplayResult] = []
    for i, policy in enumerate(parsed):
        if progress is not None:
            progress(i, len(parsed), policy.name)
        results.append(run_time_replay(workload, cluster, policy, settings))
    if progress is not None:
        progress(len(parsed), len(parsed), "done")
    header = (
        f"time replay: {workload.name} ({len(workload)} pods) on {cluster.name}: "
        f"{cluster.summary()}; window {settings.batch_timeout_s:g} s / {settings.batch_idle_s:g} s "
        f"(greedy: nos's 60 s / 10 s), apply delay {settings.apply_delay_s:g} s"
    )
    text = header + "\n" + format_table([summarize(r) for r in results])
    text += "".join(f"\nwarning: {w}" for w in replay_warnings(results))
    if out is not None:
        md = write_replay_report(
            results,
            out,
            title=f"Time replay: {workload.name} on {cluster.name}",
            context={
                "workload": f"{workload.name} ({len(workload)} pods, {workload.source})",
                "cluster": f"{cluster.name}: {cluster.summary()}",
                "batch window": f"{settings.batch_timeout_s:g} s / {settings.batch_idle_s:g} s",
                "apply delay": f"{settings.apply_delay_s:g} s",
                "time compression": settings.time_compression,
            },
        )
        text += f"\nwrote {md}"
    return text, results
