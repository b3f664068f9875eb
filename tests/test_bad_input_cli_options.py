"""Bad option values of ``simulate``, ``sweep``, ``bench`` and ``plan``: exit code 2 with one
line naming the option and the fix, before any work -- never a traceback, a hang, or results
lost after the work (``--out`` that cannot be written)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

import pytest

from gpuslice.cli import BadInput, main
from gpuslice.options import out_folder
from simulations.bench_saturation import write_report
from simulations.reports.replay_report import ReportWriteError, write_replay_report

MIG_WORKLOAD = {
    "pods": [
        {
            "name": "a",
            "cpu_milli": 1,
            "requests": {"nvidia.com/mig-1g.10gb": 1},
            "creation_time": 0,
            "deletion_time": 100,
        }
    ]
}
SHARE_WORKLOAD = (
    "pods:\n"
    "  - {name: a, cpu_milli: 1000, num_gpu: 1, gpu_milli: 100, creation_time: 0, "
    "deletion_time: 600}\n"
)
CLUSTER = {
    "pools": [
        {
            "name": "a",
            "count": 2,
            "gpus_per_node": 1,
            "cpu_milli": 1,
            "memory_mib": 1,
            "gpu_model": "A100-SXM4-80GB",
            "mode": "mig",
        }
    ]
}


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "mig.json").write_text(json.dumps(MIG_WORKLOAD))
    (tmp_path / "share.yaml").write_text(SHARE_WORKLOAD)
    (tmp_path / "c.json").write_text(json.dumps(CLUSTER))
    (tmp_path / "afile").write_text("")
    return {name: str(tmp_path / name) for name in ("mig.json", "share.yaml", "c.json", "afile")}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``gpuslice ARGV``: exit code (argparse's usage errors included), stdout, stderr."""
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = int(e.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def refused(rc: int, err: str, *parts: str) -> None:
    assert rc == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert all(p in last for p in parts), last


def _never(*_: Any, **__: Any) -> NoReturn:
    pytest.fail("the work started although --out could not be written")


# -- 1. --out that cannot be made: refused before the work -------------------------------------


SATURATION = ["--repeats", "1", "--policy", "bestfit", "--quiet"]
SWEEP_GRID = ["--timeouts", "10", "--idles", "2", "--weights", "default", "--quiet"]


def _commands(f: dict[str, str]) -> dict[str, tuple[list[str], str]]:
    """name -> (argv, the attribute whose call is the work)."""
    return {
        "simulate-time-replay": (
            ["simulate", "--trace", f["mig.json"], "--cluster", f["c.json"], "--quiet"],
            "simulations.reports.replay_protocol.run_replay_protocol",
        ),
        "simulate-saturation": (
            ["simulate", "--trace", f["share.yaml"], "--cluster", f["c.json"], *SATURATION],
            "gpuslice.commands.simulate.run_policy",
        ),
        "simulate-both": (["simulate", "--quiet"], "gpuslice.commands.simulate.run_policy"),
        "sweep": (
            ["sweep", "--trace", f["mig.json"], "--cluster", f["c.json"], *SWEEP_GRID],
            "simulations.replay.sweep.run_sweep",
        ),
        "bench-planner": (
            ["bench", "planner", "--sizes", "2", "--instances", "1", "--quiet"],
            "simulations.bench_planner.run_args",
        ),
        "bench-controller": (
            ["bench", "controller", "--nodes", "2", "--pods", "120", "--pending", "12", "--quiet"],
            "simulations.bench_controller.run_args",
        ),
    }


COMMANDS = [
    "simulate-time-replay",
    "simulate-saturation",
    "simulate-both",
    "sweep",
    "bench-planner",
    "bench-controller",
]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("where", ["under-a-file", "uncreatable"])
def test_an_out_folder_that_cannot_be_made_is_refused_before_the_work(
    command: str,
    where: str,
    files: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if where == "uncreatable":
        if not Path("/proc/self").is_dir():
            pytest.skip("needs /proc")
        out = "/proc/gpuslice-no-such-folder/out"
    else:
        out = f"{files['afile']}/sub"
    argv, work = _commands(files)[command]
    monkeypatch.setattr(work, _never)
    rc, _, err = run(capsys, *argv, "--out", out)
    refused(rc, err, f"--out {out}", "give a folder you can write")
    if where == "under-a-file":
        assert f"{files['afile']} is a file, not a folder" in err


def test_out_folder_makes_the_folders_and_refuses_a_folder_where_a_file_goes(
    tmp_path: Path,
) -> None:
    assert out_folder(None) is None
    made = out_folder(str(tmp_path / "a" / "b"), ["x.json", "sub/", "part/y.md"])
    assert made == tmp_path / "a" / "b"
    assert (made / "sub").is_dir() and (made / "part").is_dir()
    assert not (made / "x.json").exists()  # files are written by the command, at the end
    (made / "x.json").mkdir()
    with pytest.raises(BadInput, match=r"x\.json is a folder, where a file is to be written"):
        out_folder(str(made), ["x.json"])
    (tmp_path / "plain").write_text("")
    with pytest.raises(BadInput, match="plain is a file, not a folder"):
        out_folder(str(tmp_path / "plain"))
    with pytest.raises(BadInput, match="is a file, not a folder"):
        out_folder(str(tmp_path), ["plain/z.json"])


def test_bench_refuses_an_out_whose_report_file_is_a_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "planner.json").mkdir()
    monkeypatch.setattr("simulations.bench_planner.run_args", _never)
    rc, _, err = run(capsys, "bench", "planner", "--sizes", "2", "--out", str(tmp_path))
    refused(rc, err, f"--out {tmp_path}", "planner.json is a folder")
    # the first releases' --out FILE: its folder is checked before the run too
    bad = tmp_path / "afile"
    bad.write_text("")
    rc, _, err = run(capsys, "bench", "planner", "--sizes", "2", "--out", f"{bad}/b.json")
    refused(rc, err, f"--out {bad}/b.json: {bad} is a file, not a folder")


# -- 1b. the writers: a clear error, and results kept when writing fails at the end --------------


def test_the_report_writers_name_a_folder_they_cannot_make(tmp_path: Path) -> None:
    blocker = tmp_path / "afile"
    blocker.write_text("")
    with pytest.raises(ReportWriteError, match=f"cannot write the report into {blocker}/r"):
        write_replay_report([], blocker / "r")
    with pytest.raises(ReportWriteError, match=f"cannot write the report into {blocker}/s"):
        write_report(blocker / "s", [], {})
    assert issubclass(ReportWriteError, ValueError)  # callers' ValueError handling holds


def test_simulate_prints_its_results_when_the_report_cannot_be_written_at_the_end(
    files: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fail(out_dir: Path, *_: Any) -> NoReturn:
        raise ReportWriteError(f"cannot write the report into {out_dir}: Disk quota exceeded")

    monkeypatch.setattr("gpuslice.commands.simulate.write_report", fail)
    out = tmp_path / "out"
    rc, stdout, err = run(capsys, "simulate", "--trace", files["share.yaml"], "--cluster",
                          files["c.json"], "--repeats", "1", "--policy", "bestfit", "--quiet",
                          "--out", str(out))  # fmt: skip
    refused(rc, err, f"--out {out}", "Disk quota exceeded", "the results are printed above")
    assert "saturation protocol: share (1 pods)" in stdout and "bestfit" in stdout


def test_sweep_prints_its_results_when_the_files_cannot_be_written_at_the_end(
    files: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fail(*_: Any) -> NoReturn:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("simulations.replay.sweep.plot_sweep", fail)
    argv, _ = _commands(files)["sweep"]
    rc, stdout, err = run(capsys, *argv, "--out", str(tmp_path / "out"))
    refused(rc, err, "No space left on device", "the results are printed above")
    assert "recommended: batch timeout 10 s" in stdout


def test_bench_prints_its_results_when_the_file_cannot_be_written_at_the_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"

    def run_args(*_: Any) -> dict[str, Any]:
        (out / "planner.json").mkdir()  # the file's place is taken during the run
        return {"benchmark": "planner", "sizes": []}

    monkeypatch.setattr("simulations.bench_planner.run_args", run_args)
    rc, stdout, err = run(capsys, "bench", "planner", "--sizes", "2", "-o", "json",
                          "--out", str(out))  # fmt: skip
    refused(rc, err, f"could not write {out / 'planner.json'}", "the results are printed above")
    assert json.loads(stdout)["benchmark"] == "planner"


# -- 2. sweep: every numeric option finite and in range ----------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("--apply-delay", "inf", "from 0 to 86400"),
        ("--apply-delay", "nan", "from 0 to 86400"),
        ("--apply-delay", "-1", "from 0 to 86400"),
        ("--compression", "nan", "from 0.001 to 1000000"),
        ("--compression", "inf", "from 0.001 to 1000000"),
        ("--compression", "0", "from 0.001 to 1000000"),
        ("--batch-retry-seconds", "-1", "from 0 to 86400"),
        ("--batch-retry-seconds", "nan", "from 0 to 86400"),
        ("--retry", "inf", "from 0 to 86400"),
        ("--timeouts", "inf", "each positive and at most 86400"),
        ("--timeouts", "10,nan", "each positive and at most 86400"),
        ("--idles", "1e9", "each positive and at most 86400"),
        ("--copies", "1000000", "from 1 to 100"),
        ("--copies", "0", "from 1 to 100"),
    ],
)
def test_sweep_refuses_a_number_out_of_range_at_parse_time(
    option: str,
    value: str,
    expected: str,
    files: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("simulations.replay.sweep.run_sweep", _never)
    argv, _ = _commands(files)["sweep"]
    rc, _, err = run(capsys, *argv, f"{option}={value}")
    refused(rc, err, f"argument {option}", expected, repr(value))


def test_sweep_help_states_the_bounds() -> None:
    import argparse

    from gpuslice.commands import sweep

    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    text = " ".join(parser.format_help().split())
    for bound in ("from 0.001 to 1000000", "from 1 to 100", "from 0 to 86400",
                  "each positive and at most 86400"):  # fmt: skip
        assert bound in text, bound


def test_sweep_accepts_the_bounds_themselves(
    files: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv, _ = _commands(files)["sweep"]
    rc, stdout, err = run(capsys, *argv, "--apply-delay", "86400", "--batch-retry-seconds", "0",
                          "--compression", "1e6", "--copies", "2")  # fmt: skip
    assert rc == 0, err
    assert "recommended:" in stdout


# -- 3. bench: planner options bounded, and checked alike for either target --------------------

BENCH_CASES = [
    (["--pending-fraction", "nan"], "--pending-fraction must be from 0 to 10"),
    (["--pending-fraction", "inf"], "--pending-fraction must be from 0 to 10"),
    (["--pending-fraction", "1e7"], "--pending-fraction must be from 0 to 10"),
    (["--sizes", "1000000"], "--sizes must be at most 10000 nodes each"),
    (["--instances", "1000"], "--instances must be at most 100"),
    (["--time-limit", "nan"], "--time-limit must be positive and at most 3600 s"),
    (["--time-limit", "inf"], "--time-limit must be positive and at most 3600 s"),
    (["--time-limit", "-1"], "--time-limit must be positive and at most 3600 s"),
    (["--seed", "99999999999999999999"], "--seed must be from 0 to 2147483647"),
    (["--workers", "100000"], "--workers must be from 1 to 256"),
    (["--gpus-per-node", "1000"], "--gpus-per-node must be from 1 to 16"),
    (["--occupancy", "nan"], "--occupancy must be between 0 and 1"),
]


@pytest.mark.parametrize("target", ["planner", "controller"])
@pytest.mark.parametrize(("argv", "message"), BENCH_CASES)
def test_bench_refuses_bad_planner_options_for_either_target(
    target: str,
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("simulations.bench_planner.run_args", _never)
    monkeypatch.setattr("simulations.bench_controller.run_args", _never)
    if "--sizes" not in argv and "--instances" not in argv:
        argv = ["--sizes", "2", *argv]
    rc, _, err = run(capsys, "bench", target, *argv)
    refused(rc, err, message)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nodes", "100000000"], "--nodes must be at most 10000"),
        (["--pods", "100000000"], "--pods must be at most 500000"),
        (["--cycles", "1000000"], "must be at most 10000"),
        (["--snapshot-repeats", "1000000"], "at most 1000"),
    ],
)
def test_bench_controller_bounds_its_sizes(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("simulations.bench_controller.run_args", _never)
    rc, _, err = run(capsys, "bench", "controller", *argv)
    refused(rc, err, message)


def test_python_m_bench_planner_refuses_them_too(capsys: pytest.CaptureFixture[str]) -> None:
    from simulations import bench_planner

    with pytest.raises(SystemExit) as done:
        bench_planner.main(["--pending-fraction", "nan"])
    assert done.value.code == 2
    assert "--pending-fraction must be from 0 to 10" in capsys.readouterr().err


# -- 4. plan: --time-limit and --seed named ----------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--time-limit", "inf"], "--time-limit must be positive and at most 3600 s, got inf"),
        (["--time-limit", "nan"], "--time-limit must be positive and at most 3600 s, got nan"),
        (["--time-limit", "-1"], "--time-limit must be positive and at most 3600 s, got -1"),
        (["--time-limit", "1e300"], "--time-limit must be positive and at most 3600 s"),
        (
            ["--seed", "99999999999999999999"],
            "--seed must be from 0 to 2147483647, got 99999999999999999999",
        ),
        (["--seed", "-1"], "--seed must be from 0 to 2147483647, got -1"),
    ],
)
def test_plan_names_a_bad_time_limit_or_seed(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("gpuslice.commands.plan.plan", _never)
    rc, _, err = run(capsys, "plan", "--demo", *argv)
    refused(rc, err, message)


def test_plan_accepts_the_bounds_themselves(capsys: pytest.CaptureFixture[str]) -> None:
    rc, stdout, err = run(capsys, "plan", "--demo", "--policy", "greedy", "--seed", "2147483647",
                          "--time-limit", "3600")  # fmt: skip
    assert rc == 0, err
    assert "Planned 11 pending pod(s)" in stdout
