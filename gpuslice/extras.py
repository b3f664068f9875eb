"""Optional extras a subcommand needs, checked before it runs.

``pip install gpuslice`` (and the container image) carries what the partitioner and the node
agent import.  The what-if tooling -- ``gpuslice simulate`` and ``gpuslice sweep`` -- also
needs the ``sim`` extra (numpy arrays, matplotlib plots).  A subcommand whose extra is missing
stops before doing any work, with exit code 2 and the ``pip install`` that adds it, rather
than with a traceback halfway through a replay.  ``--help`` still works without it.

``bench planner`` needs no extra: it measures the planner alone, so it also runs in the image.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from gpuslice.cli import BadInput

__all__ = ["EXTRAS", "NEEDS", "missing_modules", "require_extra"]

EXTRAS: dict[str, tuple[str, ...]] = {"sim": ("numpy", "matplotlib")}
"""Extra (``[project.optional-dependencies]`` of pyproject.toml) -> the modules it provides."""

NEEDS: dict[str, str] = {"simulate": "sim", "sweep": "sim"}
"""Subcommand -> the extra it needs."""


def missing_modules(
    extra: str, find_spec: Callable[[str], Any] = importlib.util.find_spec
) -> list[str]:
    """The modules of ``extra`` that cannot be imported here."""
    return [m for m in EXTRAS[extra] if find_spec(m) is None]


def require_extra(
    command: str, find_spec: Callable[[str], Any] = importlib.util.find_spec
) -> None:
    """Raise :class:`~gpuslice.cli.BadInput` naming the pip command if ``command``'s extra is
    missing."""
    extra = NEEDS.get(command)
    if extra is None:
        return
    missing = missing_modules(extra, find_spec)
    if missing:
        raise BadInput(
            f"this command needs the '{extra}' extra, and {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not installed: run "
            f"pip install 'gpuslice[{extra}]' (the container image leaves the what-if tooling "
            f"out; run it on a workstation)"
        )
