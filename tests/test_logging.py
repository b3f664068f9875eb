"""Structured logs (contract/logs.py): one setting, the same fields in both components.

What is checked, and against what:

* a record in either format carries ``ts`` (RFC 3339, UTC, the record's own time), ``level``,
  ``logger`` and ``msg``, then its object fields (from ``extra``, from kopf's object reference,
  from the process's constant fields), then the traceback;
* the partitioner (the real kopf operator against kmock) writes kopf's records and its own in
  the chosen format, names kopf's handlers by their ids (never ``<locals>``), and keeps kopf's
  per-event success lines at DEBUG;
* ``gpuslice partitioner`` and ``gpuslice agent`` read ``GPUSLICE_LOG_FORMAT`` and
  ``GPUSLICE_LOG_LEVEL`` (the chart's ``logging.format`` / ``logging.level``); the agent is run as
  a process, the partitioner in-process with its operator replaced (it needs an API server).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kmock
import kopf
import pytest
from fake_apiserver import ApiServer, declare
from test_partitioner_operator import A100, create, eventually, node, pod, settings

from contract import logs
from partitioner.operator import Controller, configure_logging, run_operator

ROOT = Path(__file__).resolve().parent.parent
TS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")
_VALUE = r'(?:"(?:[^"\\]|\\.)*"|[^\s"]+)'
TEXT_LINE = re.compile(
    rf"^(?P<ts>\S+) (?P<level>[A-Z]+) +(?P<logger>[\w.]+): (?P<msg>.*?)"
    rf"(?P<fields>(?: \w+={_VALUE})*)$"
)
TEXT_FIELD = re.compile(rf" (\w+)=({_VALUE})")


@pytest.fixture(autouse=True)
def restore_root_logger() -> Iterator[None]:
    """configure() changes the root logger: put it back after each test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def kmock_options() -> dict[str, Any]:
    return {"cls": ApiServer}


def record(
    msg: str = "plan %s written",
    args: tuple[Any, ...] = ("7",),
    *,
    level: int = logging.INFO,
    name: str = "gpuslice.partitioner",
    exc: bool = False,
    **extra: Any,
) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            exc_info = sys.exc_info()
    rec = logging.LogRecord(name, level, __file__, 1, msg, args, exc_info)
    rec.__dict__.update(extra)
    return rec


def parse_text(line: str) -> dict[str, str]:
    m = TEXT_LINE.match(line)
    assert m, f"not a text log line: {line!r}"
    out = {k: m.group(k) for k in ("ts", "level", "logger", "msg")}
    for key, value in TEXT_FIELD.findall(m.group("fields")):
        out[key] = json.loads(value) if value.startswith('"') else value
    return out


# -- the formatters ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_every_record_has_time_level_logger_and_message(fmt: str) -> None:
    rec = record(level=logging.WARNING, plan="7", node="gpu-1")
    rec.created = datetime(2025, 6, 1, 10, 0, 0, 123000, tzinfo=UTC).timestamp()
    formatter = logs.JsonFormatter() if fmt == "json" else logs.TextFormatter()
    line = formatter.format(rec)
    assert "\n" not in line
    fields = json.loads(line) if fmt == "json" else parse_text(line)
    assert fields == {
        "ts": "2025-06-01T10:00:00.123Z",
        "level": "WARNING",
        "logger": "gpuslice.partitioner",
        "msg": "plan 7 written",
        "plan": "7",
        "node": "gpu-1",
    }
    if fmt == "json":
        assert list(json.loads(line))[:4] == list(logs.FIELD_ORDER)


def test_timestamp_is_the_records_own_time_in_utc() -> None:
    rec = record()
    fields = json.loads(logs.JsonFormatter().format(rec))
    assert TS.fullmatch(fields["ts"])
    parsed = datetime.strptime(fields["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
    assert abs(parsed.timestamp() - rec.created) < 0.001


@pytest.mark.parametrize(
    ("ref", "want"),
    [
        ({"kind": "Pod", "name": "p1", "namespace": "ml"}, {"pod": "ml/p1"}),
        ({"kind": "Node", "name": "gpu-1", "namespace": None}, {"node": "gpu-1"}),
        ({"kind": "NodePartitioning", "name": "gpu-1"}, {"node": "gpu-1"}),
        ({"kind": "Secret", "name": "tls", "namespace": "gs"}, {"object": "Secret/gs/tls"}),
    ],
)
def test_kopf_object_references_become_object_fields(
    ref: dict[str, Any], want: dict[str, str]
) -> None:
    rec = record(
        "Handler 'watch-pods' succeeded.", (), name="kopf.objects", k8s_ref=ref, k8s_skip=True
    )
    fields = json.loads(logs.JsonFormatter().format(rec))
    assert {k: v for k, v in fields.items() if k not in logs.FIELD_ORDER} == want
    assert fields["msg"] == "Handler 'watch-pods' succeeded."


def test_call_fields_win_over_kopf_reference_and_constant_fields() -> None:
    rec = record(node="from-call", k8s_ref={"kind": "Node", "name": "from-kopf"})
    fmt = logs.JsonFormatter({"node": "constant", "cluster": "c1"})
    fields = json.loads(fmt.format(rec))
    assert (fields["node"], fields["cluster"]) == ("from-call", "c1")
    only_constant = json.loads(fmt.format(record()))
    assert only_constant["node"] == "constant"


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_exceptions_keep_their_traceback(fmt: str) -> None:
    formatter = logs.JsonFormatter() if fmt == "json" else logs.TextFormatter()
    out = formatter.format(record("step failed", (), level=logging.ERROR, exc=True))
    if fmt == "json":
        fields = json.loads(out)
        assert fields["level"] == "ERROR" and fields["msg"] == "step failed"
        exc = fields["exc"]
    else:
        first, _, exc = out.partition("\n")
        assert parse_text(first)["msg"] == "step failed"
    assert exc.startswith("Traceback") and exc.rstrip().endswith("RuntimeError: boom")


def test_text_quotes_values_with_spaces_and_json_writes_odd_values_as_text() -> None:
    rec = record(reason="GPU in use", gpus=[0, 1])
    text = parse_text(logs.TextFormatter().format(rec))
    assert text["reason"] == "GPU in use" and text["gpus"] == "[0, 1]"
    fields = json.loads(logs.JsonFormatter().format(rec))
    assert fields["reason"] == "GPU in use" and fields["gpus"] == "[0, 1]"


def test_configure_replaces_its_own_handler_keeps_others_and_sets_the_level() -> None:
    root = logging.getLogger()
    other = logging.NullHandler()
    root.addHandler(other)
    first, second = io.StringIO(), io.StringIO()
    logs.configure("text", "INFO", stream=first)
    handler = logs.configure("json", "WARNING", stream=second)
    assert other in root.handlers and handler in root.handlers
    assert [h for h in root.handlers if isinstance(h, logs.LogHandler)] == [handler]
    logging.getLogger("gpuslice.test").info("dropped: below WARNING")
    logging.getLogger("gpuslice.test").warning("kept")
    assert first.getvalue() == ""
    (line,) = second.getvalue().splitlines()
    assert json.loads(line)["msg"] == "kept"
    with pytest.raises(ValueError, match="log format 'xml': expected text or json"):
        logs.configure("xml", "INFO")  # type: ignore[arg-type]


# -- the partitioner: kopf's records and ours --------------------------------------------------


async def run_partitioner(api: kmock.KubernetesEmulator, **overrides: Any) -> list[str]:
    """Run the real operator until it planned one pod; the log lines it wrote."""
    stream = io.StringIO()
    s = settings(**overrides)
    configure_logging(s, stream=stream)
    declare(api)
    await create(api, "/api/v1/nodes", node("n1", {"gpuslice.io/partitioning": "mig", **A100}))
    await create(api, "/api/v1/namespaces/default/pods", pod("p1", "nvidia.com/mig-1g.10gb"))
    info = kopf.ConnectionInfo(server=str(api.url).rstrip("/"))
    loop = asyncio.get_running_loop()
    controller = Controller(s, connection=info, clock=loop.time)
    stop = asyncio.Event()
    task = asyncio.create_task(run_operator(controller, stop_flag=stop))
    try:
        await eventually(lambda: "plan=" in stream.getvalue() or '"plan"' in stream.getvalue(), 60)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)
    return stream.getvalue().splitlines()


@pytest.mark.looptime
async def test_partitioner_json_logs_cover_kopf_and_its_own_records(kmock: ApiServer) -> None:
    lines = await run_partitioner(kmock, log_format="json", log_level="INFO")
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    for r in records:
        assert list(r)[:4] == list(logs.FIELD_ORDER) and TS.fullmatch(r["ts"]), r
        assert r["level"] in ("INFO", "WARNING", "ERROR"), r
    loggers = {r["logger"] for r in records}
    assert any(name.startswith("kopf.") for name in loggers), loggers
    (plan,) = [r for r in records if r["logger"] == "gpuslice.partitioner" and "plan" in r]
    assert plan["plan"] == "1" and plan["msg"].startswith("plan 1: 1 pod(s) in batch")
    startup = [r["msg"] for r in records if r["logger"] == "kopf.activities.startup"]
    assert startup == ["Activity 'start-controller' succeeded."]
    assert not [r for r in records if "<locals>" in r["msg"]]
    # one success line per watch event of every pod would flood the log: DEBUG only
    assert not [r for r in records if r["logger"] == "kopf.objects" and "succeeded" in r["msg"]]


@pytest.mark.looptime
async def test_partitioner_debug_text_logs_show_kopf_routine_lines_at_debug(
    kmock: ApiServer,
) -> None:
    lines = await run_partitioner(kmock, log_format="text", log_level="DEBUG")
    parsed = [parse_text(line) for line in lines if TS.match(line)]
    assert len(parsed) >= 5
    watch = [r for r in parsed if r["msg"] == "Handler 'watch-nodes' succeeded."]
    assert watch and {r["level"] for r in watch} == {"DEBUG"}
    assert {r["node"] for r in watch} == {"n1"}  # kopf's object reference, as a field
    assert not [line for line in lines if "<locals>" in line]


def test_partitioner_command_configures_logging_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``gpuslice partitioner`` with GPUSLICE_LOG_FORMAT=json: kopf's and our records are JSON."""
    import partitioner.operator as operator_module
    from gpuslice.cli import main

    async def fake_operator(controller: Controller, **_: Any) -> None:
        logging.getLogger("kopf._core.reactor.running").info("operator started")
        logging.getLogger("gpuslice.partitioner").warning("cycle", extra={"plan": "3"})
        logging.getLogger("gpuslice.partitioner").debug("not shown at INFO")

    monkeypatch.setattr(operator_module, "run_operator", fake_operator)
    for key, value in {
        "GPUSLICE_LOG_FORMAT": "json",
        "GPUSLICE_LOG_LEVEL": "info",
        "GPUSLICE_METRICS_PORT": "0",
        "GPUSLICE_HEALTH_PORT": "0",
        "GPUSLICE_WEBHOOK_ENABLED": "false",
    }.items():
        monkeypatch.setenv(key, value)
    assert main(["partitioner"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(r["logger"], r["level"], r["msg"], r.get("plan")) for r in records] == [
        ("kopf._core.reactor.running", "INFO", "operator started", None),
        ("gpuslice.partitioner", "WARNING", "cycle", "3"),
    ]


# -- the node agent ----------------------------------------------------------------------------


GPUSLICE = "import sys; from gpuslice.cli import main; sys.exit(main(sys.argv[1:]))"
"""The ``gpuslice`` console script, run by this interpreter."""
AGENT = [sys.executable, "-c", GPUSLICE, "agent", "--fake", "--fake-mig-enabled", "--spec"]


def run_agent(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    spec = tmp_path / "np.yaml"
    spec.write_text(
        "planId: '4'\nmode: mig\ngpus:\n  - index: 0\n    mig:\n"
        "      - {profile: 3g.40gb, start: 0}\n      - {profile: 3g.40gb, start: 4}\n"
    )
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GPUSLICE_")}
    environ |= {"GPUSLICE_NODE_NAME": "gpu-7", **env}
    return subprocess.run(
        [*AGENT, str(spec), "--once", "-o", "json"],
        capture_output=True,
        text=True,
        env=environ,
        cwd=ROOT,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_agent_honours_the_log_format_and_names_its_node(tmp_path: Path, fmt: str) -> None:
    done = run_agent(tmp_path, GPUSLICE_LOG_FORMAT=fmt, GPUSLICE_LOG_LEVEL="INFO")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["planId"] == "4"  # the status, on stdout
    lines = done.stderr.splitlines()
    assert lines
    records = [json.loads(x) if fmt == "json" else parse_text(x) for x in lines]
    for r in records:
        assert TS.fullmatch(r["ts"]) and r["level"] in ("INFO", "WARNING", "ERROR"), r
        assert r["node"] == "gpu-7", r
    assert any(
        r["logger"] == "gpuslice.agent" and r["msg"].startswith("advertised devices")
        for r in records
    )


def test_agent_log_level_drops_lower_records(tmp_path: Path) -> None:
    quiet = run_agent(tmp_path, GPUSLICE_LOG_FORMAT="json", GPUSLICE_LOG_LEVEL="ERROR")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""
    bad = run_agent(tmp_path, GPUSLICE_LOG_FORMAT="xml")
    assert bad.returncode == 2
    # one line naming the setting and its variable (not pydantic's multi-line dump)
    assert bad.stderr.startswith(
        "gpuslice agent: error: invalid agent settings: log_format (GPUSLICE_LOG_FORMAT): "
    )
    assert "'text'" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert "errors.pydantic.dev" not in bad.stderr
    bad = run_agent(tmp_path, GPUSLICE_XID_IGNORE="48,abc")
    assert bad.returncode == 2
    assert "xid_ignore[1] (GPUSLICE_XID_IGNORE): " in bad.stderr
