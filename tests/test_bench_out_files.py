"""Benchmarks refuse an output file they could not write before they run (exit status 2), and
bench_replay's ``--render*`` refuse input files that are not its ``--out`` documents."""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from simulations.reports.out_file import out_file_error


def test_out_file_error_names_the_problem_and_accepts_a_writable_path(tmp_path: Path) -> None:
    assert out_file_error("--out", None) is None
    assert out_file_error("--out", "") is None
    assert out_file_error("--out", str(tmp_path / "new.json")) is None
    (tmp_path / "old.json").write_text("{}")
    assert out_file_error("--out", str(tmp_path / "old.json")) is None  # replaced at the end

    folder = out_file_error("--out", str(tmp_path))
    assert folder == f"--out {tmp_path}: is a folder; name a file in it"

    missing = tmp_path / "no" / "such" / "r.json"
    problem = out_file_error("--records", str(missing))
    assert problem is not None
    assert problem.startswith(f"--records {missing}: folder {missing.parent} does not exist")
    # a benchmark that creates folders only needs the nearest existing one to be writable
    assert out_file_error("--out", str(missing), make_folders=True) is None

    blocker = tmp_path / "plain-file"
    blocker.write_text("")
    under_file = blocker / "r.json"
    problem = out_file_error("--out", str(under_file), make_folders=True)
    assert problem is not None and f"folder {blocker} does not exist" in problem


def _cli(module: str) -> Callable[[list[str]], int]:
    """``python -m simulations.<module> ARGV``'s exit status (argparse's usage errors exit)."""

    def run(argv: list[str]) -> int:
        main = importlib.import_module(f"simulations.{module}").main
        try:
            return int(main(argv))
        except SystemExit as e:
            return int(e.code or 0)

    return run


_replay = _cli("bench_replay")
_partitioned = _cli("bench_partitioned")


@pytest.mark.parametrize(
    ("run", "argv", "option"),
    [
        (_replay, [], "--out"),
        (_replay, ["--report", "{bad}"], "--report"),
        (_cli("bench_random_replay"), ["--cases", "0-199"], "--out"),
        (_cli("bench_planner"), [], "--out"),
        (_cli("bench_controller"), [], "--out"),
        (_cli("bench_saturation"), [], "--out"),
        (_partitioned, ["--records", "{bad}"], "--records"),
    ],
    ids=["replay", "replay-report", "random", "planner", "controller", "saturation", "partitioned"],
)
def test_a_benchmark_refuses_an_output_file_it_could_not_write_before_it_runs(
    run: Callable[[list[str]], int],
    argv: list[str],
    option: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bad = str(tmp_path / "missing-folder" / "result.json")
    args = [a.replace("{bad}", bad) for a in argv]
    if option == "--out":
        args += ["--out", bad]
    started = time.perf_counter()
    assert run(args) == 2
    # refused up front: the full run these arguments ask for takes minutes to hours
    assert time.perf_counter() - started < 20
    err = capsys.readouterr().err
    assert f"{option} {bad}: folder {tmp_path / 'missing-folder'} does not exist" in err


def test_bench_partitioned_creates_the_folders_of_its_out_and_markdown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --out and --markdown get their folders made at the end, so only an unusable path is
    # refused: here a folder given as the file
    assert _partitioned(["--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path}: is a folder" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--render", "--render-modes", "--render-shaped"])
@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "cannot be read"),
        ("not json {", "is not JSON"),
        (json.dumps({"benchmark": "other"}), "has no 'cells' list"),
        (json.dumps([1, 2]), "has no 'cells' list"),
        (json.dumps({"cells": [{"trace": "default"}]}), "cell 0 lacks trace, nodes or policies"),
        (
            json.dumps({"cells": [{"trace": "default", "nodes": 4, "policies": {"cpsat": {}}}]}),
            "no cell ran all of",
        ),
        (
            json.dumps(
                {
                    "cells": [
                        {
                            "trace": "default",
                            "nodes": 4,
                            "gpus": 32,
                            "policies": {p: {} for p in ("cpsat", "greedy", "dra", "dra-shaped")},
                        }
                    ]
                }
            ),
            "a run lacks",
        ),
    ],
    ids=[
        "missing",
        "not-json",
        "other-document",
        "a-list",
        "cell-without-nodes",
        "one-policy-only",
        "runs-without-figures",
    ],
)
def test_render_refuses_files_that_are_not_its_out_documents(
    flag: str,
    content: str | None,
    expected: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "replay.json"
    if content is not None:
        path.write_text(content)
    assert _replay([flag, str(path)]) == 2
    err = capsys.readouterr().err
    assert expected in err
    assert str(path) in err
