"""Reading the CLI's tables back in tests (:mod:`gpuslice.output`'s plain-text form).

A table is a header line of upper-case column names and one line per row; columns are two or
more spaces apart and cells never hold two spaces in a row, so a line splits on runs of 2+
spaces.  The table ends at the first empty line.
"""

from __future__ import annotations

import re

__all__ = ["table"]


def table(text: str, first_header: str) -> list[dict[str, str]]:
    """The rows of the table in ``text`` whose header line starts with ``first_header``."""
    lines = text.splitlines()
    start = next(
        (i for i, line in enumerate(lines) if line.startswith(first_header)), None
    )
    assert start is not None, f"no table headed {first_header!r} in:\n{text}"
    header = re.split(r" {2,}", lines[start].strip())
    rows = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        cells = re.split(r" {2,}", line.strip())
        assert len(cells) <= len(header), f"more cells than columns: {line!r}"
        rows.append(dict(zip(header, cells, strict=False)))
    return rows
