"""Settings every gpuslice process shares: catalog override files and logging.

The partitioner's and the node agent's settings classes derive from :class:`CommonSettings`, so
``GPUSLICE_CATALOG_FILES``, ``GPUSLICE_LOG_LEVEL`` and ``GPUSLICE_LOG_FORMAT`` mean the same in
both and are parsed in one place; so are renamed variables (``RENAMED_ENV``).
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from contract.renamed_env import fill_from_renamed, renamed_in_use

__all__ = ["MAX_SETTING", "CommonSettings", "split_commas"]

MAX_SETTING = 1e9
"""The largest magnitude a numeric setting without an upper bound of its own takes (seconds:
some 31 years; counts, sizes): beyond it a value is a typo, and an infinite or vast one breaks
what it feeds (CP-SAT's int64 objective, the reservation times the partitioner must read back,
int32 Lease durations).  A field with its own upper bound (``le``/``lt``: ports, the planner's
seed and time limit, weights) is held to that bound instead, tighter or wider: the seed is a
32-bit integer, up to 2147483647."""


def _own_bounds(field: FieldInfo) -> tuple[bool, bool]:
    """Whether the field has a lower bound (``ge``/``gt``) and an upper bound (``le``/``lt``)
    of its own."""
    names = {
        name
        for item in field.metadata
        for name in ("ge", "gt", "le", "lt")
        if getattr(item, name, None) is not None
    }
    return bool(names & {"ge", "gt"}), bool(names & {"le", "lt"})


def split_commas(value: object) -> object:
    """A comma-separated environment value as its non-empty, stripped items; anything else
    (a list given in code) as it is.  For ``mode="before"`` validators of list settings."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPUSLICE_", extra="forbid", frozen=True)

    catalog_files: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="GPU catalog override files (JSON/YAML), comma-separated in the environment.",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Log level."
    )
    log_format: Literal["text", "json"] = Field("text", description="Log line format.")

    RENAMED_ENV: ClassVar[Mapping[str, str]] = {}
    """Old environment variable -> the field now read (:mod:`contract.renamed_env`); each
    component's class names its own."""

    @model_validator(mode="before")
    @classmethod
    def _renamed_env(cls, data: Any) -> Any:
        return fill_from_renamed(data, cls.RENAMED_ENV)

    def renamed_env_notes(self) -> list[str]:
        """Deprecation sentences for old variable names still set, to log at start."""
        return renamed_in_use(self.RENAMED_ENV)

    def unknown_env_notes(self, environ: Mapping[str, str] | None = None) -> list[str]:
        """One sentence per ``GPUSLICE_*`` environment variable that names no setting of this
        component (a typo, or another component's setting), to log at start: such a variable
        is ignored, and an operator who set ``GPUSLICE_BATCH_TIMEOUT`` meaning
        ``GPUSLICE_BATCH_TIMEOUT_SECONDS`` would otherwise never learn why nothing changed."""
        env = os.environ if environ is None else environ
        known = {f"GPUSLICE_{name.upper()}" for name in type(self).model_fields}
        notes = []
        for key in sorted(env):
            if not key.startswith("GPUSLICE_") or key in known or key in self.RENAMED_ENV:
                continue
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8)
            notes.append(
                f"environment variable {key} is not a setting of this component and is "
                "ignored" + (f"; did you mean {close[0]}?" if close else "")
            )
        return notes

    @field_validator("*", mode="before")
    @classmethod
    def _whole_float_text(cls, value: Any, info: ValidationInfo) -> Any:
        """An integer setting given as a whole number in float notation (``1.23456789e+08``,
        ``100.0``) is that integer: Helm reads every number of a values file as a float and
        ``quote`` prints one of a million or more that way, so a chart value such as
        ``planner.seed: 123456789`` otherwise stopped the partitioner at every start.  Any
        finite whole number converts, so the field's bound then decides and its message names
        the bound (``1.5e+09`` is a valid seed; ``2e+06`` is a weight over 1000000).  A
        fraction (``1.5``) is still refused."""
        if not isinstance(value, str) or info.field_name is None:
            return value
        field = cls.model_fields.get(info.field_name)
        if field is None or field.annotation not in (int, int | None):
            return value
        text = value.strip()
        if not text or text.lstrip("+-").isdigit():
            return value
        try:
            number = float(text)
        except ValueError:
            return value
        if math.isfinite(number) and number == int(number):
            return int(number)
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _bounded_number(cls, value: Any, info: ValidationInfo) -> Any:
        """Every number is finite and at most :data:`MAX_SETTING` in magnitude, except on a side
        where the field has a bound of its own (pydantic has checked that one, and it decides:
        the seed goes up to 2147483647)."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            return value
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"must be a finite number (at most {MAX_SETTING:g}), got {value}")
        field = cls.model_fields.get(info.field_name) if info.field_name else None
        own_lower, own_upper = _own_bounds(field) if field is not None else (False, False)
        if (value > MAX_SETTING and not own_upper) or (value < -MAX_SETTING and not own_lower):
            raise ValueError(f"must be at most {MAX_SETTING:g} in magnitude")
        return value

    @field_validator("catalog_files", mode="before")
    @classmethod
    def _split_files(cls, value: object) -> object:
        return split_commas(value)

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_level(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value
