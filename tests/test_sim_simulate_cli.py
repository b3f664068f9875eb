"""``gpuslice simulate`` (built-in default, options, report files, bad input) and the
saturation benchmark's argument handling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_tables import table

from gpuslice.cli import main
from simulations.bench_saturation import main as bench_main
from simulations.bench_saturation import parse_seeds
from simulations.inputs.openb import OPENB_DIR_ENV
from simulations.saturation.runner import ROWS


def test_default_run_prints_the_comparison_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--repeats", "2"]) == 0
    out, err = capsys.readouterr()
    saturation, replay = out.split("\n\n")
    assert saturation.startswith(
        "saturation protocol: builtin-synthetic (500 pods) on builtin-demo"
    )
    rows = table(saturation, "POLICY")
    assert [r["POLICY"] for r in rows] == list(ROWS)
    assert {r["PROTOCOL"] for r in rows} == {"scheduler", "partitioner"}
    # then the time replay of the partitioning policies on the built-in MIG scenario
    assert replay.startswith("time replay: sweep-default")
    lines = table(replay, "POLICY")
    assert {r["POLICY"] for r in lines} == {"cpsat", "greedy", "static:balanced"}
    assert [r["DISRUPTED"] for r in lines] == ["0", "0", "0"]
    assert "\r" not in err  # stderr is not a terminal here: no progress bar drawn into it


def test_out_dir_gets_markdown_png_and_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wl = tmp_path / "w.yaml"
    wl.write_text(
        "pods:\n  - {name: a, cpu_milli: 1000, num_gpu: 1, gpu_milli: 600, replicas: 6}\n  - {name: c, cpu_milli: 500}\n"
    )
    cl = tmp_path / "c.yaml"
    cl.write_text(
        "pools:\n  - {name: n, count: 2, gpu_model: T4, gpus_per_node: 2, cpu_milli: 8000, memory_mib: 1000}\n"
    )
    out = tmp_path / "out"
    rc = main(
        [
            "simulate",
            "--trace",
            str(wl),
            "--cluster",
            str(cl),
            "--policy",
            "fgd,gpuslice",
            "--seed",
            "3",
            "--repeats",
            "1",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 0
    assert sorted(p.name for p in out.iterdir()) == ["allocation.png", "report.md", "results.json"]
    doc = json.loads((out / "results.json").read_text())
    assert set(doc["summary"]) == {"fgd", "gpuslice"}
    assert doc["runs"][0]["seed"] == 3 and len(doc["curves"][0]["alloc"]) == 131
    # 4 GPUs, 600-milli pods: one per GPU, so 60 %; each pod is 15 % of capacity, so the
    # 1 %-bins near 130 % hold no event
    assert doc["summary"]["fgd"]["final_alloc"] == 60.0
    assert "alloc@130" not in doc["summary"]["fgd"]
    captured = capsys.readouterr()
    assert "n/a" in captured.out
    # --quiet: no progress, only what was written
    assert captured.err.splitlines() == [
        f"wrote {out / name}" for name in ("report.md", "allocation.png", "results.json")
    ]
    report = (out / "report.md").read_text()
    assert (
        report.startswith("# gpuslice simulate") and "\nfgd " in report and "\ngpuslice " in report
    )
    assert (out / "allocation.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policy", "worstfit"], "--policy 'worstfit': unknown ['worstfit']"),
        (["--cluster", "/nope.yaml"], "cluster '/nope.yaml': not 'openb' and no such file"),
        (["--trace", "/nope.yaml", "--cluster", "builtin"], "cannot read workload file /nope.yaml"),
        (
            ["--trace", "no-such-trace", "--cluster", "builtin"],
            "no openb trace named 'no-such-trace'",
        ),
        (["--trace", "default"], "--trace default needs --cluster: give the cluster"),
        (["--repeats", "0"], "--repeats must be from 1 to 1000, got 0"),
        (["--repeats", "1000000"], "--repeats must be from 1 to 1000, got 1000000"),
        (["--batch", "0"], "--batch must be from 1 to 10000, got 0"),
        (["--batch", "99999999"], "--batch must be from 1 to 10000, got 99999999"),
        (["--cpu-scheduler", "spread"], "unknown CPU scheduler 'spread'; choose one of"),
        (
            ["--policy", "fgd", "--cpu-scheduler", "least-allocated"],
            "row 'fgd' places every pod itself",
        ),
        (["--agent-outage", "a100-0:1:2"], "--agent-outage needs the time replay"),
        (
            ["--protocol", "time-replay", "--agent-outage", "a100-9:1:2"],
            "has no node a100-9 (its nodes: a100-0, a100-1)",
        ),
        (
            ["--protocol", "time-replay", "--agent-outage", "a100-0:50:20"],
            "give a node name and 0 <= start < end",
        ),
        (["--protocol", "time-replay", "--agent-outage", "a100-0"], "expected NODE:START:END"),
    ],
)
def test_bad_input_exits_2_naming_the_fix(
    argv: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(OPENB_DIR_ENV, str(tmp_path))
    assert main(["simulate", "--quiet", *argv]) == 2
    assert message in capsys.readouterr().err


def test_bench_seed_parsing_and_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_seeds("42-45") == [42, 43, 44, 45]
    assert parse_seeds("1,3-4") == [1, 3, 4]
    with pytest.raises(ValueError, match="use '42-51'"):
        parse_seeds("a-b")
    assert bench_main(["--policies", "worstfit"]) == 2
    assert "unknown policies ['worstfit']" in capsys.readouterr().err


def test_an_agent_outage_in_the_built_in_time_replay(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--protocol", "time-replay", "--policy", "cpsat,greedy", "--quiet"]
    assert main([*argv, "-o", "json"]) == 0
    calm = {s["policy"]: s for s in json.loads(capsys.readouterr().out)["summaries"]}
    assert main([*argv, "--agent-outage", "a100-0:600:4200", "-o", "json"]) == 0
    hit = {s["policy"]: s for s in json.loads(capsys.readouterr().out)["summaries"]}
    for policy in ("cpsat", "greedy"):  # half the cluster's agents stopped for an hour
        assert hit[policy]["pending_mean_s"] > calm[policy]["pending_mean_s"]
        assert hit[policy]["never_scheduled"] == 0
    assert hit["cpsat"]["admission_rejections"] <= hit["greedy"]["admission_rejections"]
    assert hit["cpsat"]["theft"] == 0 and hit["cpsat"]["pods_disrupted"] == 0
