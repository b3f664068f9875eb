"""Load the GPU catalog with user override files (the file-reading edge of ``planner.catalog``).

An override file is read and parsed within the limits of :mod:`contract.input_files` (size,
encoding, nesting, aliases, duplicate keys, finite numbers) before :func:`planner.catalog.
parse_catalog` sees it, as canonical JSON.  Whatever is still wrong in its structure -- a
field of the wrong type deep inside a model -- becomes a :class:`~planner.catalog.CatalogError`
naming the file, never a traceback.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from contract.input_files import InputError, load_document
from planner.catalog import Catalog, CatalogError, default_catalog, parse_catalog

MAX_CATALOG_BYTES = 4 * 1024 * 1024
"""The built-in catalog, every GPU model of the facts sheet, is about 30 KiB."""


def load_catalog(extra_files: Sequence[str | Path] = ()) -> Catalog:
    """The built-in catalog with each user file's models added or overriding, in order."""
    cat = default_catalog()
    for f in extra_files:
        path = Path(f)
        try:
            doc = load_document(
                path,
                "catalog override",
                fmt="json" if path.suffix.lower() == ".json" else "yaml",
                max_bytes=MAX_CATALOG_BYTES,
            )
        except InputError as e:
            raise CatalogError(str(e)) from None
        if not isinstance(doc, dict):
            raise CatalogError(f"{path}: expected a mapping with a 'models' list")
        try:
            cat = parse_catalog(json.dumps(doc), str(path), base=cat)
        except CatalogError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            raise CatalogError(
                f"{path}: not a valid catalog override ({type(e).__name__}: {e}); write it in "
                "the format of planner/data/gpu_catalog.json (models with name, memory_mib, "
                "geometry and profiles)"
            ) from None
    return cat
