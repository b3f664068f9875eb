"""Parameter sweeps of the time replay: batch window and planner weights -> a recommendation.

Model
-----
A sweep runs :func:`simulations.replay.run_time_replay` once per grid point
(:class:`SweepPoint`: batch timeout, batch idle, a named planner-weight preset) on the same
workload, cluster and policy, and summarises each run (:mod:`simulations.replay_metrics`).
Points with ``idle > timeout`` are skipped (the idle rule could never fire).

Recommendation (:func:`recommend`): among the runs with **zero disruptions and no planner
error**, the one with the smallest p95 pending time; ties go to fewer pods never scheduled,
then the smaller p50, then fewer reconfigurations per hour, then the grid order.  ``None``
when no run qualifies.

Weight presets (:data:`WEIGHT_PRESETS`) override :class:`planner.settings.PlannerSettings`
fields: ``default`` (as shipped), ``low-churn`` (reconfiguration costs doubled) and
``keep-free`` (whole free GPUs and large free blocks valued 4x).

The default scenario (:func:`default_scenario`) is small so the default grid (3 timeouts x
2 idles x 2 presets, CP-SAT) runs in well under two minutes on two cores: 160 synthetic pods
(sizes from 1g to whole GPUs, Poisson arrivals every 50 s on average, 20 min mean run time)
on two nodes of four A100-80GB GPUs in MIG mode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from planner.snapshot import Mode
from simulations.cluster import Cluster, Node
from simulations.replay import ReplayPolicy, ReplaySettings, run_time_replay
from simulations.replay_metrics import ReplaySummary, summarize
from simulations.workload import PodShape, SyntheticSpec, Workload, synthetic_workload

__all__ = [
    "DEFAULT_IDLES",
    "DEFAULT_TIMEOUTS",
    "WEIGHT_PRESETS",
    "SweepError",
    "SweepPoint",
    "SweepRow",
    "default_scenario",
    "grid",
    "plot_sweep",
    "recommend",
    "run_sweep",
    "sweep_table",
]

DEFAULT_TIMEOUTS: tuple[float, ...] = (10.0, 30.0, 60.0)
DEFAULT_IDLES: tuple[float, ...] = (2.0, 10.0)
WEIGHT_PRESETS: Mapping[str, Mapping[str, int]] = {
    "default": {},
    "low-churn": {"weight_destroy": 8, "weight_create": 4, "weight_gpu_touched": 16},
    "keep-free": {"weight_free_gpu": 16, "weight_free_block": 4},
}


_DEFAULT_SETTINGS = ReplaySettings()


class SweepError(ValueError):
    """A sweep grid is invalid (unknown preset, empty grid)."""


@dataclass(frozen=True, slots=True)
class SweepPoint:
    timeout_s: float
    idle_s: float
    weights: str = "default"

    def label(self) -> str:
        return f"{self.timeout_s:g}/{self.idle_s:g} {self.weights}"


@dataclass(frozen=True, slots=True)
class SweepRow:
    point: SweepPoint
    summary: ReplaySummary


def grid(
    timeouts: Iterable[float] = DEFAULT_TIMEOUTS,
    idles: Iterable[float] = DEFAULT_IDLES,
    weights: Iterable[str] = ("default", "low-churn"),
) -> list[SweepPoint]:
    """Every (timeout, idle, preset) with ``idle <= timeout``, in that nesting order."""
    ws = list(weights)
    for w in ws:
        if w not in WEIGHT_PRESETS:
            raise SweepError(f"unknown weight preset {w!r}; known: {', '.join(WEIGHT_PRESETS)}")
    points = [SweepPoint(t, i, w) for t in timeouts for i in idles for w in ws if 0 < i <= t]
    if not points:
        raise SweepError(
            "the sweep grid is empty: give positive timeouts and idles with idle <= timeout"
        )
    return points


def settings_for(point: SweepPoint, base: ReplaySettings) -> ReplaySettings:
    overrides: dict[str, Any] = dict(WEIGHT_PRESETS[point.weights])
    return replace(
        base,
        batch_timeout_s=point.timeout_s,
        batch_idle_s=point.idle_s,
        planner=replace(base.planner, **overrides),
    )


def run_sweep(
    workload: Workload,
    cluster: Cluster,
    points: Sequence[SweepPoint],
    policy: ReplayPolicy,
    base: ReplaySettings = _DEFAULT_SETTINGS,
    progress: Callable[[int, int, SweepRow], None] | None = None,
) -> list[SweepRow]:
    """One replay per point (the policy's own window is replaced by the point's)."""
    pol = replace(policy, window=None)
    rows: list[SweepRow] = []
    for i, point in enumerate(points):
        result = run_time_replay(workload, cluster, pol, settings_for(point, base))
        row = SweepRow(point, summarize(result))
        rows.append(row)
        if progress is not None:
            progress(i + 1, len(points), row)
    return rows


def recommend(rows: Sequence[SweepRow]) -> SweepRow | None:
    """The row the module docstring's rule picks, or ``None``."""
    ok = [
        (i, r)
        for i, r in enumerate(rows)
        if r.summary.pods_disrupted == 0 and r.summary.planner_errors == 0
    ]
    if not ok:
        return None
    return min(
        ok,
        key=lambda ir: (
            ir[1].summary.pending_p95_s,
            ir[1].summary.never_scheduled,
            ir[1].summary.pending_p50_s,
            ir[1].summary.reconfigurations_per_hour,
            ir[0],
        ),
    )[1]


def sweep_table(rows: Sequence[SweepRow], best: SweepRow | None) -> str:
    header = [
        "timeout s",
        "idle s",
        "weights",
        "p50 s",
        "p95 s",
        "p99 s",
        "never",
        "reconf/h",
        "disrupted",
        "plans",
        "",
    ]
    body = [
        [
            f"{r.point.timeout_s:g}",
            f"{r.point.idle_s:g}",
            r.point.weights,
            f"{r.summary.pending_p50_s:.0f}",
            f"{r.summary.pending_p95_s:.0f}",
            f"{r.summary.pending_p99_s:.0f}",
            str(r.summary.never_scheduled),
            f"{r.summary.reconfigurations_per_hour:.2f}",
            str(r.summary.pods_disrupted),
            str(r.summary.plans),
            "<- recommended" if r is best else "",
        ]
        for r in rows
    ]
    widths = [max(len(x[i]) for x in [header, *body]) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
        for line in [header, *body]
    )


def plot_sweep(rows: Sequence[SweepRow], best: SweepRow | None, path: str | Path) -> Path:
    """Bar chart of p95 pending time per grid point; the recommendation highlighted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = Path(path)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(rows) + 2), 4.5))
    labels = [r.point.label() for r in rows]
    values = [r.summary.pending_p95_s for r in rows]
    colors = ["tab:green" if r is best else "tab:blue" for r in rows]
    ax.bar(range(len(rows)), values, color=colors)
    ax.set_xticks(range(len(rows)), labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("p95 pending time (s)")
    ax.set_title("Sweep: batch timeout/idle and planner weights (green: recommended)")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def default_scenario(seed: int = 7) -> tuple[Workload, Cluster]:
    """The small built-in workload and cluster (module docstring)."""
    mix = (
        PodShape(5, 2000, 8192, 1, 120),  # 1g
        PodShape(3, 4000, 16384, 1, 280),  # 2g
        PodShape(2, 6000, 32768, 1, 420),  # 3g
        PodShape(1, 8000, 32768, 1, 550),  # 4g
        PodShape(1, 12000, 65536, 1, 1000),  # whole GPU
    )
    spec = SyntheticSpec(
        count=160, mix=mix, arrival_rate_per_s=1 / 50, mean_duration_s=1200, seed=seed
    )
    workload = synthetic_workload(spec, name="sweep-default")
    nodes = tuple(
        Node(
            f"a100-{i}",
            cpu_milli=96000,
            memory_mib=786432,
            gpus=4,
            model="A100-SXM4-80GB",
            mode=Mode.MIG,
            catalog_model="A100-SXM4-80GB",
        )
        for i in range(2)
    )
    return workload, Cluster("sweep-default", nodes, source="built-in")
