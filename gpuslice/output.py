"""How every ``gpuslice`` command prints its results: ``-o table|wide|json|yaml``.

Model: a command builds one JSON-ready document (dicts, lists, strings, numbers) and hands it
to :func:`emit` with a function that turns it into text.  ``-o json`` and ``-o yaml`` print the
document itself, so scripts get every field; ``table`` (the default) and ``wide`` print the
text, whose tables come from :func:`render_table` -- the one table renderer of the CLI (rich,
kubectl's style: upper-case headers, no borders, columns two spaces apart).  ``wide`` adds the
columns marked :attr:`Column.wide`, as ``kubectl get -o wide`` does.

Tables are plain text: no colour and, when stdout is not a terminal, no width limit (a line is
as long as its cells; nothing is cut or wrapped), so the output can be grepped and diffed.  On
a terminal, cells that do not fit its width wrap inside their column.

``--json``, the flag of the first releases, stays as a hidden, deprecated spelling of
``-o json`` (:func:`add_output_argument`); it prints a one-line note on stderr.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TextIO

from gpuslice.options import DeprecatedAlias

__all__ = [
    "FORMATS",
    "Column",
    "add_output_argument",
    "emit",
    "render_table",
    "to_json",
    "to_yaml",
]

FORMATS: tuple[str, ...] = ("table", "wide", "json", "yaml")
"""The ``-o`` values, default first."""


def add_output_argument(
    parser: argparse.ArgumentParser,
    *,
    formats: Sequence[str] = FORMATS,
    json_alias: bool = False,
    what: str = "the result",
) -> None:
    """Add ``-o/--output FORMAT`` (default ``table``); ``json_alias``: also the hidden,
    deprecated ``--json``."""
    parser.add_argument(
        "-o",
        "--output",
        choices=list(formats),
        default=formats[0],
        metavar="FORMAT",
        help=f"print {what} as {', '.join(formats[:-1])} or {formats[-1]} "
        f"(default {formats[0]}{'; wide: more columns' if 'wide' in formats else ''})",
    )
    if json_alias:
        parser.add_argument("--json", dest="output", nargs=0, const="json",
                            action=DeprecatedAlias, new="-o json", help=argparse.SUPPRESS)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Column:
    """One table column: its header, how to get the cell from a row, and when it is shown."""

    header: str
    value: str | Callable[[Mapping[str, Any]], Any]
    """A key of the row, or a function of the row."""
    wide: bool = False
    """Only with ``-o wide``."""
    align: Literal["left", "right"] = "left"

    def cell(self, row: Mapping[str, Any]) -> str:
        v = row.get(self.value) if isinstance(self.value, str) else self.value(row)
        if v is None:
            return "-"
        if isinstance(v, bool):
            return "yes" if v else "no"
        if isinstance(v, list | tuple):
            return ", ".join(str(x) for x in v) or "-"
        return str(v)


def _width(stream: TextIO) -> int | None:
    """The terminal's width when ``stream`` is one, else ``None`` (no limit)."""
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return shutil.get_terminal_size().columns
    return None


def render_table(
    columns: Sequence[Column],
    rows: Sequence[Mapping[str, Any]],
    *,
    wide: bool = False,
    width: int | None = None,
) -> str:
    """The rows as a table (module docstring); ``width`` ``None``: unlimited."""
    import io

    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    shown = [c for c in columns if wide or not c.wide]
    table = Table(box=None, pad_edge=False, show_edge=False, padding=(0, 1), header_style="")
    for c in shown:
        table.add_column(c.header.upper(), justify=c.align, overflow="fold")
    for row in rows:
        table.add_row(*(Text(c.cell(row)) for c in shown))  # Text: no markup, no emoji codes
    buf = io.StringIO()
    console = Console(
        file=buf,
        width=width or 100_000,
        color_system=None,
        force_terminal=False,
        highlight=False,
        emoji=False,
    )
    console.print(table)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines())


def to_json(doc: Any) -> str:
    return json.dumps(doc, indent=2)


def to_yaml(doc: Any) -> str:
    import yaml

    text: str = yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=100_000)
    return text.rstrip("\n")


def emit(
    doc: Any,
    output: str,
    text: Callable[[bool, int | None], str],
    stream: TextIO | None = None,
) -> None:
    """Print ``doc`` in the ``-o`` format ``output``; ``text(wide, width)`` makes the table
    and wide forms (``width``: the terminal's, ``None`` when stdout is not one)."""
    out = stream if stream is not None else sys.stdout
    if output == "json":
        body = to_json(doc)
    elif output == "yaml":
        body = to_yaml(doc)
    elif output in ("table", "wide"):
        body = text(output == "wide", _width(out))
    else:  # argparse's choices keep this out
        raise ValueError(f"unknown output format {output!r}; choose from {', '.join(FORMATS)}")
    print(body, file=out)
