"""The CLI's conventions, across every subcommand (issue 14, item 3).

* ``gpuslice --version`` prints the package metadata's version and exits 0;
* every command that reports takes ``-o table|wide|json|yaml`` (a table by default; yaml and
  json carry the same document; wide adds columns), and the old ``--json`` still works;
* one flag per concept (``--catalog``; the old spellings are hidden, deprecated aliases) and one
  meaning per ``GPUSLICE_*`` variable (the retry that meant 60 s in one component and 2 s in the
  other now has two names; the old name is still read, with a warning);
* help text shows plain defaults and says what the command writes -- checked against the files
  it does write; nothing is written without ``--out``;
* progress is drawn only on a terminal (:mod:`gpuslice.progress`);
* a trace without a cluster is refused with exit 2.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml
from cli_tables import table

from gpuslice.cli import COMMANDS, main
from gpuslice.commands import partitioner as partitioner_cmd
from gpuslice.output import Column, render_table
from gpuslice.progress import Progress
from node_agent.settings import AgentSettings
from partitioner.settings import PartitionerSettings

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "clusters"
GPUSLICE = "import sys; from gpuslice.cli import main; sys.exit(main(sys.argv[1:]))"

WORKLOAD = (
    "pods:\n"
    "  - {name: a, cpu_milli: 1000, num_gpu: 1, gpu_milli: 100, creation_time: 0, deletion_time: 600}\n"
    "  - {name: b, cpu_milli: 1000, num_gpu: 1, gpu_milli: 1000, creation_time: 30, deletion_time: 900}\n"
    "  - {name: c, cpu_milli: 1000, num_gpu: 1, gpu_milli: 400, creation_time: 40, deletion_time: 500}\n"
)
MIG_CLUSTER = (
    "name: small\npools:\n  - {name: a100, count: 1, gpu_model: A100-SXM4-80GB, gpus_per_node: 2,"
    " cpu_milli: 32000, memory_mib: 262144, mode: mig}\n"
)
SPEC = "mode: mig\ngpus:\n- index: 1\n  mig: [{profile: 4g.40gb, start: 0}, {profile: 3g.40gb, start: 4}]\n"


@pytest.fixture(autouse=True)
def _logging_as_it_was() -> Iterator[None]:
    """``gpuslice agent`` configures the root logger with a handler on this test's stderr
    (closed afterwards): put the root logger back as it was, for the tests after this one."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "wl.yaml").write_text(WORKLOAD)
    (tmp_path / "mig.yaml").write_text(MIG_CLUSTER)
    (tmp_path / "spec.yaml").write_text(SPEC)
    return {k: str(tmp_path / f) for k, f in [("wl", "wl.yaml"), ("cl", "mig.yaml"), ("spec", "spec.yaml")]}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def parser_of(command: str) -> argparse.ArgumentParser:
    import importlib

    module = importlib.import_module(COMMANDS[command][0])
    parser = argparse.ArgumentParser(prog=f"gpuslice {command}")
    module.add_arguments(parser)
    return parser


def help_of(command: str) -> str:
    return " ".join(parser_of(command).format_help().split())


# -- --version --------------------------------------------------------------------------------


def test_version_prints_the_package_version_and_exits_0() -> None:
    done = subprocess.run(
        [sys.executable, "-c", GPUSLICE, "--version"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"gpuslice {version('gpuslice')}\n"
    no_command = subprocess.run(
        [sys.executable, "-c", GPUSLICE], capture_output=True, text=True, check=False
    )
    assert no_command.returncode == 2 and "COMMAND" in no_command.stdout
    as_module = subprocess.run(  # python -m gpuslice: where the console script is not on PATH
        [sys.executable, "-m", "gpuslice", "--version"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT.parent,
    )
    assert as_module.returncode == 0, as_module.stderr
    assert as_module.stdout == done.stdout


# -- -o on every command that reports ----------------------------------------------------------

NOT_REPORTING = {
    "partitioner": "a controller: it logs, it reports nothing",
    "ungate": "an action: one line per object changed, as kubectl delete prints",
}


def test_every_reporting_command_has_the_output_flag() -> None:
    for command in COMMANDS:
        flags = {s for a in parser_of(command)._actions for s in a.option_strings}
        if command in NOT_REPORTING:
            assert "-o" not in flags, f"{command} reports after all: drop it from NOT_REPORTING"
            continue
        assert {"-o", "--output"} <= flags, f"gpuslice {command} has no -o/--output"
        out = next(a for a in parser_of(command)._actions if "-o" in a.option_strings)
        assert out.default in ("table", "yaml") and {"json"} <= set(out.choices or ())


def reporting_commands(files: dict[str, str]) -> dict[str, list[str]]:
    """A small, quick run of each reporting command (export has tests of its own)."""
    return {
        "plan": ["plan", "--demo", "--policy", "greedy"],
        "nos-check": ["nos-check", "--snapshot", str(FIXTURES / "nos-mps.json")],
        "bench": ["bench", "planner", "--sizes", "2", "--instances", "1", "--time-limit", "0.2",
                  "--quiet"],
        "agent": ["agent", "--fake", "--fake-gpus", "A100-SXM4-80GB:2", "--spec", files["spec"],
                  "--once"],
        "simulate": ["simulate", "--trace", files["wl"], "--cluster", files["cl"], "--policy",
                     "bestfit", "--repeats", "1", "--quiet"],
        "sweep": ["sweep", "--trace", files["wl"], "--cluster", files["cl"], "--policy", "greedy",
                  "--timeouts", "20", "--idles", "5", "--weights", "default", "--quiet"],
    }  # fmt: skip


@pytest.mark.parametrize("command", ["plan", "nos-check", "bench", "agent", "simulate", "sweep"])
def test_output_formats_print_one_document_or_a_table(
    command: str,
    files: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.chdir(tmp_path)
    argv = reporting_commands(files)[command]
    rc, as_json, _ = run(capsys, *argv, "-o", "json")
    assert rc == 0
    doc = json.loads(as_json)
    rc, as_yaml, _ = run(capsys, *argv, "-o", "yaml")
    assert rc == 0
    assert set(yaml.safe_load(as_yaml)) == set(doc)  # the same document (times may differ)
    rc, plain, _ = run(capsys, *argv)
    assert rc == 0
    rc, wide, _ = run(capsys, *argv, "-o", "wide")
    assert rc == 0
    for text in (plain, wide):
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)
    def headers(text: str) -> list[set[str]]:
        return [set(re.split(r" {2,}", line)) for line in text.splitlines() if line.isupper()]

    assert headers(plain), f"no table header in gpuslice {command}'s output:\n{plain}"
    assert any(h < w for h in headers(plain) for w in headers(wide)), (
        f"gpuslice {command} -o wide adds no column to any table"
    )
    # nothing written without --out; the fake agent's status file is its stand-in for the API
    # (documented: the spec file's status goes to <file>.status.json)
    expected = {Path(f).name for f in files.values()}
    if command == "agent":
        expected.add("spec.yaml.status.json")
    assert {p.name for p in tmp_path.iterdir()} == expected, (
        f"gpuslice {command} wrote files without --out"
    )


def test_the_catalog_check_prints_every_format_and_exits_by_agreement(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``gpuslice agent --check-catalog`` honours ``-o`` like every report (a fake driver)."""
    import pynvml
    from test_agent_catalog_probe import CAT, FakeDriver, Gpu

    from gpuslice.commands import agent

    model = CAT.model("A100-SXM4-40GB")
    bent = Gpu(model, starts={model.profile_by_shape("2g").nvml_index: (0, 2)})
    for gpus, rc_wanted in (((Gpu(model),), 0), ((Gpu(model), bent), 1)):
        docs = {}
        for output in ("json", "yaml"):
            assert agent.check_catalog(CAT, output, FakeDriver(*gpus)) == rc_wanted
            text = capsys.readouterr().out
            docs[output] = json.loads(text) if output == "json" else yaml.safe_load(text)
        assert docs["json"] == docs["yaml"] and docs["json"]["agree"] is (rc_wanted == 0)
        assert agent.check_catalog(CAT, "table", FakeDriver(*gpus)) == rc_wanted
        plain = capsys.readouterr().out
        assert agent.check_catalog(CAT, "wide", FakeDriver(*gpus)) == rc_wanted
        wide = capsys.readouterr().out
        rows = table(plain, "GPU")
        assert [r["CATALOG MODEL"] for r in rows] == [model.name] * len(gpus)
        assert "PCI ID" not in plain and "PCI ID" in wide
        differences = [d for g in docs["json"]["gpus"] for d in g["differences"]]
        assert int(rows[-1]["DIFFERENCES"]) == len(docs["json"]["gpus"][-1]["differences"])
        for d in differences:  # each difference is listed under the GPU table
            assert d in plain
    assert "SPEC.status.json" in help_of("agent")  # the one file the fake agent writes

    class Broken:
        NVMLError = pynvml.NVMLError

        def nvmlInit(self) -> None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    assert agent.check_catalog(CAT, "table", Broken()) == 2
    out, err = capsys.readouterr()
    assert out == "" and "NVML unavailable" in err


def test_bench_planner_table_matches_its_document(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "planner", "--sizes", "2", "--instances", "2", "--time-limit", "0.2", "--quiet"]
    rc, out, _ = run(capsys, *argv, "-o", "yaml")
    assert rc == 0
    (size,) = yaml.safe_load(out)["sizes"]
    rc, out, err = run(capsys, *argv)
    assert rc == 0 and err == ""  # --quiet
    (row,) = table(out, "NODES (GPUS)")
    assert row["NODES (GPUS)"] == "2 (16)"
    expected_status = ", ".join(f"{n} x {s}" for s, n in sorted(size["cpsat"]["status"].items()))
    assert row["CP-SAT STATUS"] == expected_status
    churn = f"{sum(size['cpsat']['churn_weighted']):,} vs {sum(size['greedy']['churn_weighted']):,}"
    assert row["WEIGHTED CHURN, CP-SAT VS GREEDY"] == churn


@pytest.mark.parametrize("command", ["plan", "nos-check"])
def test_the_old_json_flag_is_a_deprecated_alias(
    command: str, files: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = reporting_commands(files)[command]
    rc, old, err = run(capsys, *argv, "--json")
    assert rc == 0 and "--json is deprecated; use -o json" in err
    rc, new, err = run(capsys, *argv, "-o", "json")
    assert rc == 0 and "deprecated" not in err
    drop = {"seconds", "stats", "status"}  # the planner's own timing may differ between runs
    assert {k: v for k, v in json.loads(old).items() if k not in drop} == {
        k: v for k, v in json.loads(new).items() if k not in drop
    }
    assert "--json" not in parser_of(command).format_help()  # hidden


def test_a_bad_output_format_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["plan", "--demo", "-o", "xml"])
    assert e.value.code == 2
    assert "invalid choice: 'xml'" in capsys.readouterr().err


# -- the table renderer -------------------------------------------------------------------------


def test_tables_are_plain_uncut_and_wide_adds_columns() -> None:
    cols = (Column("name", "n"), Column("size", "s", align="right"), Column("note", "x", wide=True))
    rows = [{"n": "[bold]a[/bold] :smile:", "s": 10, "x": "y" * 300}, {"n": "b", "s": None, "x": [1, 2]}]
    text = render_table(cols, rows)
    name = "[bold]a[/bold] :smile:"  # markup and emoji codes stay literal; None is "-"
    w = len(name)
    assert text.splitlines() == [f"{'NAME':<{w}}  SIZE", f"{name}    10", f"{'b':<{w}}     -"]
    wide = render_table(cols, rows, wide=True).splitlines()
    assert wide[0].split() == ["NAME", "SIZE", "NOTE"] and wide[1].endswith("y" * 300)
    assert wide[2].endswith("1, 2") and all(line == line.rstrip() for line in wide)
    folded = render_table(cols, rows, wide=True, width=60).splitlines()
    assert max(map(len, folded)) <= 60 and len(folded) > 3  # a terminal's width: cells wrap


# -- one flag per concept, one meaning per variable --------------------------------------------


def test_catalog_is_one_repeatable_flag_with_hidden_old_spellings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for command in ("plan", "nos-check", "agent", "partitioner"):
        help_text = parser_of(command).format_help()
        assert "--catalog FILE" in help_text, command
        assert "--catalog-file" not in help_text, command
    # the agent's old --catalog-file still works (with a note); a bad catalog names the file
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: 7\n")
    rc, _, err = run(capsys, "agent", "--fake", "--catalog-file", str(bad), "--once")
    assert rc == 2 and "--catalog-file is deprecated; use --catalog" in err and str(bad) in err
    rc, _, err = run(capsys, "plan", "--demo", "--catalog", f"{bad},{bad}")
    assert rc == 2 and str(bad) in err
    # the partitioner: --catalog (repeatable, comma lists) and the old --catalog-files
    for name in [n for n in os.environ if n.startswith("GPUSLICE_")]:
        monkeypatch.delenv(name)
    args = parser_of("partitioner").parse_args(
        ["--catalog", "a.yaml,b.yaml", "--catalog-files", "c.yaml", "--planner-policy", "greedy"]
    )
    settings = partitioner_cmd._settings(args)
    assert settings.catalog_files == ["a.yaml", "b.yaml", "c.yaml"]
    assert settings.planner_policy == "greedy"
    assert "--catalog-files is deprecated" in capsys.readouterr().err


def test_partitioner_help_shows_plain_defaults_and_choices() -> None:
    text = help_of("partitioner")
    assert "<" not in text and "Policy." not in text
    assert "--planner-policy {cpsat,greedy}" in text and "(default: cpsat;" in text
    assert "--reservation {true,false}" in text and "(default: true;" in text
    assert "(default: 60; env GPUSLICE_BATCH_RETRY_SECONDS)" in text
    assert "--retry-seconds" not in text  # the old flag: hidden, still parsed
    args = parser_of("partitioner").parse_args(["--retry-seconds", "5"])
    assert args.batch_retry_seconds == "5"
    assert partitioner_cmd.plain([]) == "none" and partitioner_cmd.plain(0.5) == "0.5"


def test_the_batch_retry_has_one_flag_name_in_the_partitioner_and_the_sweep() -> None:
    for command in ("partitioner", "sweep"):
        text = help_of(command)
        assert "--batch-retry-seconds SECONDS" in text and "--retry " not in text, command
    args = parser_of("sweep").parse_args(["--retry", "5"])  # the old spelling, hidden
    assert args.retry == 5.0
    assert parser_of("sweep").parse_args(["--batch-retry-seconds", "7"]).retry == 7.0


def test_each_environment_variable_means_one_thing(monkeypatch: pytest.MonkeyPatch) -> None:
    names = {
        cls: {f"GPUSLICE_{f.upper()}" for f in cls.model_fields}
        for cls in (PartitionerSettings, AgentSettings)
    }
    shared = names[PartitionerSettings] & names[AgentSettings]
    # shared on purpose: the common settings, and each process's own /metrics port
    assert shared == {
        "GPUSLICE_CATALOG_FILES",
        "GPUSLICE_LOG_LEVEL",
        "GPUSLICE_LOG_FORMAT",
        "GPUSLICE_METRICS_PORT",
    }
    for name in [n for n in os.environ if n.startswith("GPUSLICE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("GPUSLICE_RETRY_SECONDS", "7")  # the old, two-meaning name
    p, a = PartitionerSettings(), AgentSettings()
    assert (p.batch_retry_seconds, a.reconcile_retry_seconds) == (7, 7)
    assert "rename it to GPUSLICE_BATCH_RETRY_SECONDS" in p.renamed_env_notes()[0]
    assert "rename it to GPUSLICE_RECONCILE_RETRY_SECONDS" in a.renamed_env_notes()[0]
    monkeypatch.setenv("GPUSLICE_BATCH_RETRY_SECONDS", "30")  # the new name wins
    p = PartitionerSettings()
    assert p.batch_retry_seconds == 30 and "(ignored now" in p.renamed_env_notes()[0]
    assert PartitionerSettings(batch_retry_seconds=5).batch_retry_seconds == 5  # so does a flag
    monkeypatch.delenv("GPUSLICE_RETRY_SECONDS")
    assert PartitionerSettings().renamed_env_notes() == []


def test_the_agent_logs_the_deprecated_variable(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSLICE_")}
    env |= {"GPUSLICE_RETRY_SECONDS": "3", "GPUSLICE_LOG_FORMAT": "json"}
    done = subprocess.run(
        [sys.executable, "-c", GPUSLICE, "agent", "--fake", "--fake-gpus", "A100-SXM4-80GB:2", "--spec", str(spec), "--once",
         "-o", "json"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stderr.splitlines()]
    warned = [r for r in records if "GPUSLICE_RETRY_SECONDS is deprecated" in r["msg"]]
    assert warned and warned[0]["level"] == "WARNING"
    assert json.loads(done.stdout)["conditions"][0]["status"] == "True"


def test_a_variable_that_names_no_setting_is_told_with_the_closest_name() -> None:
    """A ``GPUSLICE_*`` variable that names no setting of the component (a typo, another
    component's setting) is ignored, and was ignored silently: now a warning at start names it
    and the closest setting; renamed variables and real settings are not told."""
    from node_agent.settings import AgentSettings
    from partitioner.settings import PartitionerSettings

    env = {
        "GPUSLICE_BATCH_TIMEOUT": "5",
        "GPUSLICE_BATCH_IDLE_SECONDS": "2",
        "GPUSLICE_RETRY_SECONDS": "3",  # renamed: told by renamed_env_notes
        "GPUSLICE_TOTALLY_UNKNOWN": "1",
        "HOME": "/root",
    }
    notes = PartitionerSettings.model_construct().unknown_env_notes(env)
    assert notes == [
        "environment variable GPUSLICE_BATCH_TIMEOUT is not a setting of this component and is "
        "ignored; did you mean GPUSLICE_BATCH_TIMEOUT_SECONDS?",
        "environment variable GPUSLICE_TOTALLY_UNKNOWN is not a setting of this component and "
        "is ignored",
    ]
    agent = AgentSettings.model_construct().unknown_env_notes(env)
    assert any("GPUSLICE_BATCH_IDLE_SECONDS" in n for n in agent)  # the partitioner's, not its


# -- help text against what is written ----------------------------------------------------------


def listed_after(text: str, label: str) -> set[str]:
    """The file names the help text lists after ``label:`` (up to the next ';')."""
    part = text.split(f"{label}:", 1)[1].split(";", 1)[0]
    return set(re.findall(r"[\w-]+\.(?:md|json|png)|[\w-]+/", part))


def test_simulate_writes_what_its_help_says(
    files: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = help_of("simulate")
    assert "report.md" in text and "replay.md" in text and "Default: write nothing" in text
    for protocol in ("saturation", "time-replay"):
        out = tmp_path / protocol
        rc, _, err = run(capsys, "simulate", "--protocol", protocol, "--trace", files["wl"],
                         "--cluster", files["cl"], "--repeats", "1", "--quiet", "--out", str(out))  # fmt: skip
        assert rc == 0
        written = {p.name for p in out.iterdir()}
        assert written == listed_after(text, protocol), protocol
        wrote = {Path(x.removeprefix("wrote ")).name for x in err.splitlines() if x.startswith("wrote ")}
        assert wrote == written and "Traceback" not in err


def test_sweep_and_bench_write_what_their_help_says(
    files: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep_help = help_of("sweep")
    out = tmp_path / "sweep"
    rc, _, _ = run(capsys, "sweep", "--trace", files["wl"], "--cluster", files["cl"], "--policy",
                   "greedy", "--timeouts", "20", "--idles", "5", "--weights", "default", "--quiet",
                   "--out", str(out))  # fmt: skip
    assert rc == 0
    written = {p.name for p in out.iterdir()}
    assert written == {"sweep.json", "sweep.png"} and all(n in sweep_help for n in written)
    assert "default: write nothing" in sweep_help
    bench_help = help_of("bench")
    out = tmp_path / "bench"
    rc, _, _ = run(capsys, "bench", "planner", "--sizes", "2", "--instances", "1",
                   "--time-limit", "0.2", "--quiet", "--out", str(out))  # fmt: skip
    assert rc == 0
    assert [p.name for p in out.iterdir()] == ["planner.json"] and "DIR/planner.json" in bench_help


def test_sweep_help_states_the_churn_rule() -> None:
    text = help_of("sweep")
    assert "--max-extra-churn PERCENT" in text and "(default 10)" in text
    assert "--min-p95-gain PERCENT" in text and "(default 5)" in text


@pytest.mark.parametrize("command", ["simulate", "sweep"])
def test_a_trace_without_a_cluster_is_refused(
    command: str, files: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = run(capsys, command, "--trace", files["wl"], "--quiet")
    assert rc == 2 and out == ""
    assert f"gpuslice {command}: error: --trace {files['wl']} needs --cluster" in err
    assert "'openb'" in err and "--cluster builtin" in err


def test_simulate_on_an_mps_cluster_compares_what_applies_to_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The documented MPS example runs as written: without --policy the time replay leaves
    out the static layouts (MIG layouts), and says so; asked for one, it refuses with exit 2."""
    examples = ROOT / "docs" / "examples"
    argv = ["simulate", "--trace", str(examples / "workload-mps.yaml"),
            "--cluster", str(examples / "cluster-a100-mps.yaml"), "--quiet"]  # fmt: skip
    rc, out, err = run(capsys, *argv, "-o", "json")
    assert rc == 0, err
    assert [r["policy"] for r in json.loads(out)["summaries"]] == ["cpsat", "greedy"]
    assert "has MPS nodes: comparing cpsat, greedy (static layouts are MIG layouts)" in err
    rc, out, err = run(capsys, *argv, "--policy", "static:balanced")
    assert rc == 2 and "sets MIG layouts (whole instances); the cluster has mps or hybrid nodes" in err
    assert "static:balanced" in help_of("simulate")  # the help names the replay's default


# -- progress ------------------------------------------------------------------------------------


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_is_a_bar_only_on_a_terminal() -> None:
    clock = Clock()
    log = io.StringIO()
    bar = Progress("sweep", 10, stream=log, interval_s=30, clock=clock)
    for i in range(1, 11):
        clock.now += 10
        bar.update(i, f"run {i}")
    bar.close()
    assert "\r" not in log.getvalue() and "\x1b" not in log.getvalue()
    assert log.getvalue().splitlines() == [
        "sweep: 30% (run 3), 30 s",
        "sweep: 60% (run 6), 60 s",
        "sweep: 90% (run 9), 90 s",
    ]
    term = Terminal()
    with Progress("sweep", 4, stream=term, clock=clock) as bar:
        for i in range(1, 5):
            clock.now += 1
            bar.update(i, f"run {i}")
    drawn = term.getvalue()
    assert "sweep" in drawn and "100%" in drawn and "run 4" in drawn
    quiet = Terminal()
    with Progress("sweep", 4, stream=quiet, enabled=False, clock=clock) as bar:
        bar.update(4, "x")
    assert quiet.getvalue() == ""


def test_commands_print_no_carriage_returns_into_a_log(
    files: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, err = run(capsys, "sweep", "--trace", files["wl"], "--cluster", files["cl"],
                     "--policy", "greedy", "--timeouts", "20,60", "--idles", "5",
                     "--weights", "default", "-o", "json")  # fmt: skip
    assert rc == 0 and "\r" not in err
    assert err.splitlines()[0].startswith("sweep: 2 runs, policy greedy, 3 pods on")
