"""The replay's layout-change record (``ReplaySettings.record_changes``) and ``--trace-log``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openb_data import OPENB, needs_openb

from planner.settings import PlannerSettings
from simulations.bench_replay import main
from simulations.replay.engine import ReplaySettings, run_time_replay
from simulations.replay.metrics import layout_shape, nearest_rank, summarize
from tests.test_sim_replay import small_workload

SETTINGS = ReplaySettings(planner=PlannerSettings(time_limit_s=2))


@pytest.mark.parametrize("policy", ["cpsat", "greedy"])
def test_recorded_changes_chain_per_gpu_and_count_every_reconfigured_gpu(policy: str) -> None:
    wl, cl = small_workload()
    r = run_time_replay(
        wl, cl, policy, ReplaySettings(record_changes=True, planner=SETTINGS.planner)
    )
    changes = r.layout_changes
    assert changes and len(changes) == summarize(r).gpus_reconfigured
    last: dict[tuple[str, int], tuple[str, ...]] = {}
    for c in changes:
        assert c.before != c.after
        # each GPU's record is one chain: a change starts from the layout the last one left
        assert c.before == last.get((c.node, c.gpu), ()), (c.node, c.gpu, c.time)
        last[(c.node, c.gpu)] = c.after
        created = set(c.after) - set(c.before)
        # every change creates a device some waiting pod asks for (nothing is carved for nobody)
        profiles = {d.split("@", 1)[0] for d in created}
        assert any(f"nvidia.com/mig-{p} x" in request for p in profiles for request in c.waiting), (
            c.after,
            c.waiting,
        )
    assert [c.time for c in changes] == sorted(c.time for c in changes)


def test_recording_changes_no_decision() -> None:
    wl, cl = small_workload(seed=4)
    plain = run_time_replay(wl, cl, "cpsat", SETTINGS)
    recorded = run_time_replay(
        wl, cl, "cpsat", ReplaySettings(record_changes=True, planner=SETTINGS.planner)
    )
    assert plain.layout_changes == []
    assert plain.reconfigurations == recorded.reconfigurations
    assert [(p.name, p.first_bound) for p in plain.pods] == [
        (p.name, p.first_bound) for p in recorded.pods
    ]


def test_layout_shape_drops_positions() -> None:
    assert layout_shape(("4g.40gb@0", "3g.40gb@4")) == "4g.40gb+3g.40gb"
    assert layout_shape(()) == "-"
    assert layout_shape(("3g.40gb@4", "nvidia.com/gpu-10gb@4/0")) == "3g.40gb+nvidia.com/gpu-10gb"


@needs_openb
def test_trace_log_holds_each_replays_changes_and_pods(tmp_path: Path) -> None:
    out, log = tmp_path / "replay.json", tmp_path / "log.json"
    argv = ["--openb-dir", str(OPENB), "--nodes", "2", "--limit", "130"]
    assert main([*argv, "--out", str(out), "--trace-log", str(log)]) == 0
    doc, logged = json.loads(out.read_text()), json.loads(log.read_text())
    (cell,) = doc["cells"]
    assert set(cell["policies"]) == {"cpsat", "greedy"}
    assert all("_trace_log" not in s for s in cell["policies"].values())
    assert {e["policy"] for e in logged["cells"]} == {"cpsat", "greedy"}
    for entry in logged["cells"]:
        summary = cell["policies"][entry["policy"]]
        assert sum(entry["transitions"].values()) == summary["gpus_reconfigured"] > 0
        assert len(entry["layout_changes"]) == summary["gpus_reconfigured"]
        assert len(entry["pods"]) == summary["gpu_pods"] == 130
        waits = [p["pending_s"] for p in entry["pods"]]
        assert nearest_rank(waits, 95) == pytest.approx(summary["pending_p95_s"])
        assert nearest_rank(waits, 99) == pytest.approx(summary["pending_p99_s"])


def test_an_unwritable_trace_log_is_refused_with_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--trace-log", str(tmp_path / "missing" / "log.json")])
    assert exit_info.value.code == 2
    assert "--trace-log" in capsys.readouterr().err
