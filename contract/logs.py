"""Log lines of every gpuslice process: one setting picks JSON or text, with the same fields.

Model
-----
Every record becomes one line on stderr carrying these fields, in this order:

* ``ts``: when, RFC 3339 in UTC with milliseconds (``2025-06-01T10:00:00.123Z``);
* ``level``: ``DEBUG``, ``INFO``, ``WARNING``, ``ERROR`` or ``CRITICAL`` (the names
  ``GPUSLICE_LOG_LEVEL`` takes);
* ``logger``: the logger's name (``gpuslice.partitioner``, ``gpuslice.agent``, ``kopf.objects``);
* ``msg``: the message;
* object fields, when the record has them: ``pod`` (``namespace/name``), ``node``, ``plan``, and
  any other field a logging call passes as ``extra={...}``;
* ``exc``: the traceback, when an exception is logged.

Object fields come from three places, the first that has a field wins: the logging call's
``extra``; kopf's object reference (``k8s_ref``, set on its per-object records: a Pod gives
``pod``, a Node or a NodePartitioning gives ``node`` (one NodePartitioning per node, named after
it), any other kind ``object`` = ``Kind/[namespace/]name``); the process's constant fields given
to :func:`configure` (the node agent adds its ``node`` to every record).

``json`` writes one JSON object per line with exactly those keys (values that are not strings,
numbers, booleans or null are written as their ``str()``).  ``text`` writes
``<ts> <LEVEL> <logger>: <msg> key=value ...`` (a value with spaces, quotes or ``=`` is
JSON-quoted), then the traceback on its own lines.

This module is imported by both the partitioner and the node agent and knows nothing of kopf:
the partitioner adds its kopf-specific filter on the handler :func:`configure` returns.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final, Literal, TextIO

__all__ = [
    "FIELD_ORDER",
    "JsonFormatter",
    "LogFormat",
    "LogHandler",
    "TextFormatter",
    "configure",
    "record_fields",
]

LogFormat = Literal["text", "json"]

FIELD_ORDER: Final = ("ts", "level", "logger", "msg")
"""The fields every line starts with, in this order."""

_STANDARD_ATTRS: Final = frozenset(
    logging.LogRecord("", logging.INFO, "", 0, "", None, None).__dict__
) | {"message", "asctime", "taskName"}
"""Attributes every :class:`logging.LogRecord` has: not object fields."""

_KOPF_ATTRS: Final = frozenset({"k8s_ref", "k8s_skip", "settings"})
"""kopf's own record attributes (``k8s_ref`` is read into object fields)."""

_RESERVED: Final = frozenset({*FIELD_ORDER, "exc"})


def _timestamp(created: float) -> str:
    when = datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds")
    return when.replace("+00:00", "Z")


def _ref_fields(ref: object) -> dict[str, Any]:
    """Object fields of kopf's object reference (``{kind, name, namespace, ...}``)."""
    if not isinstance(ref, Mapping):
        return {}
    kind, name, namespace = ref.get("kind"), ref.get("name"), ref.get("namespace")
    if not name:
        return {}
    if kind == "Pod":
        return {"pod": f"{namespace}/{name}" if namespace else str(name)}
    if kind in ("Node", "NodePartitioning"):
        return {"node": str(name)}
    where = f"{namespace}/{name}" if namespace else str(name)
    return {"object": f"{kind}/{where}" if kind else where}


def record_fields(
    record: logging.LogRecord, constant: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The fields of one record, in line order (see the module docstring); ``exc`` excluded."""
    out: dict[str, Any] = {
        "ts": _timestamp(record.created),
        "level": record.levelname,
        "logger": record.name,
        "msg": record.getMessage(),
    }
    extra = {
        k: v
        for k, v in record.__dict__.items()
        if k not in _STANDARD_ATTRS
        and k not in _KOPF_ATTRS
        and k not in _RESERVED
        and not k.startswith("_")
    }
    for source in (extra, _ref_fields(getattr(record, "k8s_ref", None)), constant or {}):
        for k, v in source.items():
            if k not in out and v is not None and v != "":
                out[k] = v
    return out


def _exc_text(formatter: logging.Formatter, record: logging.LogRecord) -> str:
    parts = []
    if record.exc_info:
        parts.append(formatter.formatException(record.exc_info))
    elif record.exc_text:
        parts.append(record.exc_text)
    if record.stack_info:
        parts.append(formatter.formatStack(record.stack_info))
    return "\n".join(parts)


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per record (``json`` format)."""

    def __init__(self, constant: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.constant = dict(constant or {})

    def format(self, record: logging.LogRecord) -> str:
        fields = {k: _plain(v) for k, v in record_fields(record, self.constant).items()}
        exc = _exc_text(self, record)
        if exc:
            fields["exc"] = exc
        return json.dumps(fields, ensure_ascii=False, separators=(",", ":"))


def _text_value(value: Any) -> str:
    text = str(_plain(value))
    if not text or any(c.isspace() or c in "\"'=" for c in text):
        return json.dumps(text, ensure_ascii=False)
    return text


class TextFormatter(logging.Formatter):
    """``<ts> <LEVEL> <logger>: <msg> key=value ...`` (``text`` format)."""

    def __init__(self, constant: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.constant = dict(constant or {})

    def format(self, record: logging.LogRecord) -> str:
        fields = record_fields(record, self.constant)
        head = f"{fields.pop('ts')} {fields.pop('level'):<7} {fields.pop('logger')}: "
        line = head + str(fields.pop("msg"))
        if fields:
            line += " " + " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
        exc = _exc_text(self, record)
        return f"{line}\n{exc}" if exc else line


class LogHandler(logging.StreamHandler[TextIO]):
    """The handler :func:`configure` installs (told apart from others when replaced).

    Without an explicit stream it writes to whatever ``sys.stderr`` is at the time of each
    record, not the object it was when configured: a redirected or replaced stderr (a test
    runner's capture, ``contextlib.redirect_stderr``) then gets the record instead of a closed
    file getting a "--- Logging error ---" traceback.
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        super().__init__(stream if stream is not None else sys.stderr)
        self._follow_stderr = stream is None

    def emit(self, record: logging.LogRecord) -> None:
        if self._follow_stderr:
            self.stream = sys.stderr
        super().emit(record)


def configure(
    fmt: LogFormat,
    level: str | int,
    *,
    stream: TextIO | None = None,
    constant: Mapping[str, Any] | None = None,
) -> LogHandler:
    """Write every record of the process at ``level`` and above to ``stream`` (stderr) in ``fmt``.

    The handler goes on the root logger, so the records of libraries (kopf, aiohttp, grpc) take
    the same format; one installed by an earlier call is replaced, other handlers are kept.
    ``constant``: object fields added to every record that lacks them.  Returns the handler.
    """
    if fmt not in ("text", "json"):
        raise ValueError(f"log format {fmt!r}: expected text or json (GPUSLICE_LOG_FORMAT)")
    handler = LogHandler(stream)
    handler.setFormatter(JsonFormatter(constant) if fmt == "json" else TextFormatter(constant))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, LogHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    return handler
