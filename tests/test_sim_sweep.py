"""gpuslice sweep: grid, recommendation rule, a small real sweep, and the CLI."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from gpuslice.cli import main
from simulations.replay import ReplaySettings, parse_policy
from simulations.replay_metrics import ReplaySummary
from simulations.sweep import (
    SweepError,
    SweepPoint,
    SweepRow,
    default_scenario,
    grid,
    recommend,
    run_sweep,
    settings_for,
)

BASE = ReplaySummary(
    policy="cpsat", pods=10, pending_p50_s=0, pending_p95_s=100, pending_p99_s=200,
    never_scheduled=0, reconfigurations_per_hour=1, gpus_reconfigured=1, pods_disrupted=0,
    plans=1, plans_reused=0, planner_ms_p50=1, planner_ms_p95=1, planner_ms_max=1,
    planner_ms_mean=1, allocation_mean=0.5, allocation_max=1, span_s=10, planner_errors=0,
    wall_s=0,
)  # fmt: skip


def row(timeout: float, **changes: float) -> SweepRow:
    return SweepRow(SweepPoint(timeout, 1), replace(BASE, **changes))  # type: ignore[arg-type]


def test_grid_skips_idle_longer_than_timeout_and_unknown_presets() -> None:
    points = grid([5, 30], [2, 10], ["default", "keep-free"])
    assert [(p.timeout_s, p.idle_s) for p in points] == [
        (5, 2),
        (5, 2),
        (30, 2),
        (30, 2),
        (30, 10),
        (30, 10),
    ]
    with pytest.raises(SweepError, match="unknown weight preset"):
        grid([10], [2], ["fast"])
    with pytest.raises(SweepError, match="empty"):
        grid([1], [5], ["default"])
    s = settings_for(SweepPoint(30, 5, "low-churn"), ReplaySettings())
    assert (s.batch_timeout_s, s.batch_idle_s, s.planner.weight_destroy) == (30, 5, 8)


def test_recommend_minimises_p95_at_zero_disruption() -> None:
    rows = [
        row(1, pending_p95_s=10, pods_disrupted=2),  # best p95 but disrupts
        row(2, pending_p95_s=50, planner_errors=1),  # planner failed
        row(3, pending_p95_s=60, never_scheduled=1),
        row(4, pending_p95_s=60),  # same p95, fewer never scheduled
        row(5, pending_p95_s=80),
    ]
    best = recommend(rows)
    assert best is not None and best.point.timeout_s == 4
    assert recommend(rows[:2]) is None


def test_sweep_runs_the_replay_per_point() -> None:
    wl, cl = default_scenario()
    wl = replace(wl, pods=wl.pods[:40])
    points = grid([10, 60], [10], ["default"])
    seen: list[int] = []
    rows = run_sweep(
        wl, cl, points, parse_policy("greedy"), progress=lambda i, n, r: seen.append(i)
    )
    assert seen == [1, 2] and [r.point for r in rows] == points
    assert all(r.summary.pods == 40 and r.summary.pods_disrupted == 0 for r in rows)
    assert recommend(rows) in rows


def test_cli_prints_table_recommends_and_writes_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wl = tmp_path / "wl.yaml"
    wl.write_text(
        "pods:\n"
        "  - {name: a, cpu_milli: 1000, num_gpu: 1, gpu_milli: 100, creation_time: 0, deletion_time: 600}\n"
        "  - {name: b, cpu_milli: 1000, num_gpu: 1, gpu_milli: 1000, creation_time: 30, deletion_time: 900}\n"
        "  - {name: c, cpu_milli: 1000, num_gpu: 1, gpu_milli: 400, creation_time: 40, deletion_time: 500}\n"
    )
    out = tmp_path / "out"
    rc = main(["sweep", "--trace", str(wl), "--policy", "greedy", "--timeouts", "20,60",
               "--idles", "5", "--weights", "default", "--out", str(out)])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "<- recommended" in text and "recommended: batch timeout" in text
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    doc = json.loads((out / "sweep.json").read_text())
    assert len(doc["rows"]) == 2 and doc["recommended"]["idle_s"] == 5
    assert main(["sweep", "--weights", "fast", "--out", str(out)]) == 2
    assert "unknown weight preset" in capsys.readouterr().err
