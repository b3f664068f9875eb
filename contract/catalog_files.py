"""Load the GPU catalog with user override files (the file-reading edge of ``planner.catalog``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from planner.catalog import Catalog, CatalogError, default_catalog, parse_catalog


def load_catalog(extra_files: Sequence[str | Path] = ()) -> Catalog:
    """The built-in catalog with each user file's models added or overriding, in order."""
    cat = default_catalog()
    for f in extra_files:
        path = Path(f)
        try:
            text = path.read_text()
        except OSError as e:
            raise CatalogError(f"cannot read catalog override file {path}: {e}") from e
        cat = parse_catalog(text, str(path), base=cat)
    return cat
