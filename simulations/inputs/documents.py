"""Reading the simulator's input documents (YAML or JSON) with errors that name the file.

Files are read through :mod:`contract.input_files`: bounded size, UTF-8/16/32 with a BOM,
standard JSON, YAML without alias bombs, deep nesting, duplicate keys or non-finite numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from contract.input_files import InputError, load_document

__all__ = ["named_entry", "read_document"]


def read_document(path: Path, error: type[Exception], what: str) -> Any:
    """Parse ``path`` as JSON (``.json``) or YAML (anything else).

    Raises ``error`` naming the file: ``cannot read <what> file <path>: <reason>`` when it cannot
    be read, ``<path>: not valid JSON|YAML: <parser message>`` when it does not parse, and the
    limits' messages of :mod:`contract.input_files` otherwise.
    """
    try:
        return load_document(path, what, fmt="json" if path.suffix == ".json" else "yaml")
    except InputError as e:
        raise error(str(e)) from None


def named_entry(
    d: object, allowed: frozenset[str] | set[str], where: str, error: type[Exception], expected: str
) -> tuple[dict[str, Any], str, str]:
    """Check one list entry of a document: a mapping of known fields with a non-empty ``name``.

    Returns the mapping, its name and ``where`` extended with the name, for later messages.
    Raises ``error`` naming ``where``: not a mapping (``expected`` says what it should hold),
    unknown fields (listing the allowed ones), or a missing/empty name.
    """
    if not isinstance(d, dict):
        raise error(f"{where}: expected a mapping {expected}")
    unknown = set(d) - set(allowed)
    if unknown:
        raise error(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    name = d.get("name")
    if not isinstance(name, str) or not name:
        raise error(f"{where}: field 'name' must be a non-empty string")
    return d, name, f"{where} ({name})"
