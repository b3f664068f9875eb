"""Renamed ``GPUSLICE_*`` environment variables: the old name is read for one more release.

Model: a settings class maps each old variable name to the field that replaced it
(``{"GPUSLICE_RETRY_SECONDS": "batch_retry_seconds"}``).  :func:`fill_from_renamed` runs as the
class's ``mode="before"`` model validator: when the field got no value -- neither from its new
variable nor from the constructor -- and the old variable is set, the old variable's value is
used.  The new name always wins.  :func:`renamed_in_use` lists, for the component to log once
its logging is configured, a deprecation sentence per old variable still set.

An old name is kept only where it is unambiguous within that component: each component read
it with exactly one meaning (``GPUSLICE_RETRY_SECONDS`` was the batch retry in the partitioner
and the reconcile retry in the node agent, so each keeps reading it as its own).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = ["fill_from_renamed", "renamed_in_use"]


def fill_from_renamed(
    data: Any, renamed: Mapping[str, str], environ: Mapping[str, str] | None = None
) -> Any:
    """``data`` (the validator's input) with each renamed field filled from its old variable
    when nothing else set it."""
    env = os.environ if environ is None else environ
    if not isinstance(data, dict):
        return data
    filled = dict(data)
    for old, field in renamed.items():
        if field not in filled and old in env:
            filled[field] = env[old]
    return filled


def renamed_in_use(
    renamed: Mapping[str, str], environ: Mapping[str, str] | None = None
) -> list[str]:
    """One sentence per old variable that is set: what replaces it (and that it is ignored when
    the new one is set too)."""
    env = os.environ if environ is None else environ
    notes = []
    for old, field in renamed.items():
        if old not in env:
            continue
        new = f"GPUSLICE_{field.upper()}"
        notes.append(
            f"environment variable {old} is deprecated and will not be read after the next "
            f"release; rename it to {new}"
            + (f" (ignored now: {new} is set)" if new in env else "")
        )
    return notes
