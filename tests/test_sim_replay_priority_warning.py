"""The time replay's kube-scheduler never preempts: a replay of pods of several priorities
carries a warning, and the report, the protocol's table text and ``gpuslice simulate`` print
it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuslice.cli import main
from simulations.inputs.workload import Pod, Workload
from simulations.replay.engine import ReplayPod, run_time_replay
from simulations.replay.fake_cluster import FakeCluster
from simulations.replay.metrics import ReplayResult
from simulations.reports.replay_report import write_replay_report

A100 = "A100-SXM4-80GB"
EMPTY = Workload("none", (Pod("unused", 0),))
PREEMPT = "does not preempt"


def replay(priorities: list[int]) -> ReplayResult:
    # the low-priority pod holds the GPU; the high-priority one arrives later and waits for it
    pods = [
        ReplayPod(f"p{i}", {"nvidia.com/mig-7g.80gb": 1}, 10.0 * i, 100, priority=prio)
        for i, prio in enumerate(priorities)
    ]
    fake = FakeCluster([FakeCluster.node("n0", A100, 1)])
    return run_time_replay(EMPTY, fake, "static:all-7g", pods=pods)


def test_pods_of_several_priorities_carry_the_warning() -> None:
    r = replay([0, 1000])
    assert len(r.warnings) == 1
    warning = r.warnings[0]
    assert PREEMPT in warning and "(0, 1000)" in warning
    bound = {p.name: p.first_bound for p in r.pods}
    assert bound["p1"] is not None and bound["p1"] >= 100  # waited: production would preempt


@pytest.mark.parametrize("priorities", [[0, 0], [1000, 1000]])
def test_one_priority_carries_no_warning(priorities: list[int]) -> None:
    assert replay(priorities).warnings == []


def test_the_report_prints_the_warning_once(tmp_path: Path) -> None:
    results = [replay([0, 1000]), replay([0, 1000])]  # one warning for every policy
    md = write_replay_report(results, tmp_path)
    text = md.read_text()
    assert "## Warnings" in text and text.count(PREEMPT) == 1
    doc = json.loads((tmp_path / "replay.json").read_text())
    assert len(doc["warnings"]) == 1 and PREEMPT in doc["warnings"][0]
    plain = write_replay_report([replay([0, 0])], tmp_path / "plain")
    assert "## Warnings" not in plain.read_text()


def _files(tmp_path: Path, high: int) -> tuple[Path, Path]:
    wl = tmp_path / "w.yaml"
    wl.write_text(
        "pods:\n"
        "  - {name: ns/a, cpu_milli: 1000, requests: {nvidia.com/mig-7g.80gb: 1}, creation_time: 0, deletion_time: 300}\n"
        f"  - {{name: ns/b, cpu_milli: 1000, requests: {{nvidia.com/mig-7g.80gb: 1}}, priority: {high}, creation_time: 30, deletion_time: 200}}\n"
    )
    cl = tmp_path / "c.yaml"
    cl.write_text(
        "pools:\n  - {name: g, count: 1, gpu_model: A100-SXM4-80GB, gpus_per_node: 1, cpu_milli: 32000, memory_mib: 262144, mode: mig}\n"
    )
    return wl, cl


def test_simulate_prints_the_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wl, cl = _files(tmp_path, 1000)
    argv = ["simulate", "--trace", str(wl), "--cluster", str(cl), "--quiet"]
    argv += ["--protocol", "time-replay", "--policy", "static:all-7g"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    said = "warning: pods have different priorities (0, 1000): the replay's kube-scheduler"
    assert f"{said} {PREEMPT}" in out
    assert main([*argv, "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["warnings"]) == 1 and PREEMPT in doc["warnings"][0]
    wl, cl = _files(tmp_path, 0)
    assert main(argv) == 0
    assert "warning" not in capsys.readouterr().out
