"""Loaders for the Alibaba openb trace CSVs (cluster-trace-gpu-v2023).

Files
-----
* ``openb_pod_list_<trace>.csv``: one row per pod.  Required columns ``name, cpu_milli,
  memory_mib, num_gpu, gpu_milli``; optional ``gpu_spec, qos, pod_phase, creation_time,
  deletion_time, scheduled_time`` (``multigpu20`` has only the required five).
* ``openb_node_list_gpu_node.csv``: one row per GPU node (``sn, cpu_milli, memory_mib, gpu,
  model``), read by :func:`simulations.inputs.cluster.load_openb_nodes` with the same row reader.

Rules
-----
Values are normalised as the FGD simulator does (:func:`simulations.inputs.workload.normalise_gpu_milli`):
``gpu_milli`` is the share *per GPU*, clipped to 0..1000; a pod with no GPUs or no share is
CPU-only.  ``gpu_spec`` is a ``|``-separated model list (empty pieces dropped; empty = any).
Times are integers (seconds); an empty time cell is ``None``.

Bad rows are never skipped: every problem is collected with the file and the *line number*
(1 = the header) and :class:`TraceError` is raised listing them (the first 20 and a count).

Where the files are
-------------------
Nothing here has a built-in path.  :func:`openb_dir` resolves the directory from an explicit
argument, else the ``GPUSLICE_OPENB_DIR`` environment variable, else ``../shared/traces/openb``
next to the current directory (the layout of the development checkout); otherwise it raises
naming the fix.  :func:`resolve_trace` turns ``default`` / ``gpushare40`` / ... or a path into a
file.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from contract.input_files import MAX_TABLE_BYTES, InputError, read_text
from simulations.inputs.limits import (
    MAX_CPU_MILLI,
    MAX_GPUS_PER_NODE,
    MAX_MEMORY_MIB,
    MAX_TABLE_ROWS,
    MAX_TIME_S,
    MAX_VALUE,
)
from simulations.inputs.workload import (
    Pod,
    Workload,
    WorkloadError,
    clip,
    normalise_gpu_milli,
    parse_gpu_spec,
)

__all__ = [
    "OPENB_DIR_ENV",
    "OPENB_TRACES",
    "CsvRow",
    "TraceError",
    "load_openb_pods",
    "openb_dir",
    "raise_collected",
    "read_csv_rows",
    "resolve_trace",
]

OPENB_DIR_ENV = "GPUSLICE_OPENB_DIR"
OPENB_TRACES = ("default", "gpushare40", "multigpu20", "gpuspec10")
"""The traces the FGD paper's figures use (others of the family resolve the same way)."""

_MAX_LISTED = 20
_POD_REQUIRED = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
_POD_OPTIONAL = ("gpu_spec", "qos", "pod_phase", "creation_time", "deletion_time", "scheduled_time")


class TraceError(WorkloadError):
    """A trace or node-list file is missing, malformed, or has bad rows (line numbers listed)."""


@dataclass(frozen=True, slots=True)
class CsvRow:
    """One data row with its physical line number in the file."""

    line: int
    values: dict[str, str]

    def integer(self, column: str, errors: list[str], where: str, maximum: int = MAX_VALUE) -> int:
        """The cell as an integer (``2``, ``2.0``, ``2e3``); bad or beyond ``maximum`` in
        magnitude: an error collected, 0 returned."""
        raw = self.values.get(column, "").strip()
        value: int | None = None
        if len(raw) <= 40:  # longer is no number of ours (and slow to convert)
            try:
                value = int(raw)
            except ValueError:
                try:
                    f = float(raw)
                except ValueError:
                    f = float("nan")
                if f.is_integer():
                    value = int(f)
        if value is None:
            errors.append(f"{where}:{self.line}: column {column!r}: {raw[:40]!r} is not an integer")
            return 0
        if abs(value) > maximum:
            errors.append(
                f"{where}:{self.line}: column {column!r}: {raw!r} is beyond the limit {maximum:,}"
            )
            return 0
        return value

    def optional_integer(
        self, column: str, errors: list[str], where: str, maximum: int = MAX_VALUE
    ) -> int | None:
        raw = self.values.get(column, "").strip()
        if raw == "" or raw.lower() == "nan":
            return None
        return self.integer(column, errors, where, maximum)


def read_csv_rows(
    path: Path, required: Sequence[str], optional: Sequence[str] = ()
) -> Iterator[CsvRow]:
    """Yield the rows of ``path`` with line numbers; raise if a required column is missing.

    The file is read within :data:`contract.input_files.MAX_TABLE_BYTES` (UTF-8, a BOM allowed)
    and at most :data:`~simulations.inputs.limits.MAX_TABLE_ROWS` rows.  Rows with the wrong number of
    cells, a header naming a column twice, and cells the CSV reader refuses (e.g. over its field
    size limit) raise a :class:`TraceError` naming the line.
    """
    try:
        text = read_text(path, "trace", MAX_TABLE_BYTES)
    except InputError as e:
        raise TraceError(str(e)) from None
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        try:
            header = [h.strip() for h in next(reader)]
        except StopIteration:
            raise TraceError(
                f"{path}:1: empty file (expected a header with {', '.join(required)})"
            ) from None
        dup = sorted({h for h in header if header.count(h) > 1})
        if dup:
            raise TraceError(f"{path}:1: header names column(s) {', '.join(dup)} twice")
        missing = [c for c in required if c not in header]
        if missing:
            raise TraceError(
                f"{path}:1: header lacks column(s) {', '.join(missing)}; "
                f"expected {', '.join(required)} (optional: {', '.join(optional) or 'none'})"
            )
        rows = 0
        for cells in reader:
            if not cells or all(not c.strip() for c in cells):
                continue  # blank line
            if len(cells) != len(header):
                raise TraceError(
                    f"{path}:{reader.line_num}: {len(cells)} cells, the header has {len(header)}"
                )
            rows += 1
            if rows > MAX_TABLE_ROWS:
                raise TraceError(
                    f"{path}:{reader.line_num}: more than {MAX_TABLE_ROWS:,} rows; split the file"
                )
            yield CsvRow(reader.line_num, dict(zip(header, cells, strict=True)))
    except csv.Error as e:
        raise TraceError(f"{path}:{reader.line_num}: not valid CSV: {e}") from None


def raise_collected(path: Path, errors: list[str]) -> None:
    if errors:
        listed = "\n  ".join(errors[:_MAX_LISTED])
        more = f"\n  ... and {len(errors) - _MAX_LISTED} more" if len(errors) > _MAX_LISTED else ""
        raise TraceError(f"{path}: {len(errors)} bad row(s):\n  {listed}{more}")


def load_openb_pods(path: str | Path, name: str | None = None) -> Workload:
    """Read an ``openb_pod_list_*.csv`` file into a :class:`Workload` (rows in file order)."""
    p = Path(path)
    where = str(p)
    errors: list[str] = []
    pods: list[Pod] = []
    seen: dict[str, int] = {}
    for row in read_csv_rows(p, _POD_REQUIRED, _POD_OPTIONAL):
        n_err = len(errors)
        pod_name = row.values["name"].strip()
        if not pod_name:
            errors.append(f"{where}:{row.line}: column 'name' is empty")
        elif pod_name in seen:
            errors.append(
                f"{where}:{row.line}: duplicate pod name {clip(pod_name)!r} (first on line "
                f"{seen[pod_name]})"
            )
        cpu = row.integer("cpu_milli", errors, where, MAX_CPU_MILLI)
        mem = row.integer("memory_mib", errors, where, MAX_MEMORY_MIB)
        num_gpu = row.integer("num_gpu", errors, where, MAX_GPUS_PER_NODE)
        gpu_milli = row.integer("gpu_milli", errors, where)
        created = row.optional_integer("creation_time", errors, where, MAX_TIME_S)
        deleted = row.optional_integer("deletion_time", errors, where, MAX_TIME_S)
        scheduled = row.optional_integer("scheduled_time", errors, where, MAX_TIME_S)
        if len(errors) > n_err:
            continue
        seen[pod_name] = row.line
        num_gpu, gpu_milli = normalise_gpu_milli(num_gpu, gpu_milli)
        try:
            pods.append(
                Pod(
                    name=pod_name,
                    cpu_milli=cpu,
                    memory_mib=mem,
                    num_gpu=num_gpu,
                    gpu_milli=gpu_milli,
                    gpu_spec=parse_gpu_spec(row.values.get("gpu_spec", "")) if num_gpu else (),
                    qos=row.values.get("qos", "").strip(),
                    creation_time=created,
                    deletion_time=deleted,
                    scheduled_time=scheduled,
                )
            )
        except WorkloadError as e:
            errors.append(f"{where}:{row.line}: {e}")
    raise_collected(p, errors)
    if not pods:
        raise TraceError(f"{where}: no pod rows after the header")
    trace = name or p.stem.removeprefix("openb_pod_list_")
    return Workload(name=trace, pods=tuple(pods), source=where)


def openb_dir(explicit: str | Path | None = None) -> Path:
    """The openb trace directory: argument, ``$GPUSLICE_OPENB_DIR``, or ``../shared/traces/openb``."""
    if explicit is not None:
        d = Path(explicit)
    elif os.environ.get(OPENB_DIR_ENV):
        d = Path(os.environ[OPENB_DIR_ENV])
    else:
        d = Path.cwd().parent / "shared" / "traces" / "openb"
        if not d.is_dir():
            raise TraceError(
                "no openb trace directory: pass --openb-dir DIR or set "
                f"{OPENB_DIR_ENV} to the folder holding openb_pod_list_*.csv"
            )
    if d.exists() and not d.is_dir():
        raise TraceError(
            f"openb trace directory {d} is not a folder; pass --openb-dir DIR, the folder "
            "holding openb_pod_list_*.csv"
        )
    if not d.is_dir():
        raise TraceError(f"openb trace directory {d} does not exist; pass --openb-dir DIR")
    return d


def resolve_trace(trace: str, directory: str | Path | None = None) -> Path:
    """A trace name (``default``, ``gpushare40`` ...) or a CSV path -> the CSV file."""
    p = Path(trace)
    if p.suffix == ".csv" or p.exists():
        if p.is_dir():
            raise TraceError(f"trace file {p} is a directory; give a CSV file or a trace name")
        if not p.is_file():
            raise TraceError(f"trace file {p} does not exist")
        return p
    f = openb_dir(directory) / f"openb_pod_list_{trace}.csv"
    if not f.is_file():
        known = sorted(
            x.stem.removeprefix("openb_pod_list_") for x in f.parent.glob("openb_pod_list_*.csv")
        )
        if not known:
            raise TraceError(
                f"no openb trace named {clip(trace)!r} in {f.parent}: it holds no "
                "openb_pod_list_*.csv file; pass --openb-dir DIR, the folder holding them"
            )
        raise TraceError(
            f"no openb trace named {clip(trace)!r} in {f.parent}; known: {', '.join(known)}"
        )
    return f
