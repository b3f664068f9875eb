"""Options several commands share, spelled one way everywhere.

* ``--catalog FILE``: a GPU catalog override file (JSON or YAML), repeatable, and each value
  may be a comma-separated list -- the same list ``GPUSLICE_CATALOG_FILES`` holds.  The
  spellings of the first releases (``--catalog-file`` in ``gpuslice agent``,
  ``--catalog-files`` in ``gpuslice partitioner``) still work, hidden from ``--help``, with a
  note on stderr.
* ``-o/--output``: :mod:`gpuslice.output`.
* ``--out DIR``: the folder a command writes its report files into (created if missing);
  nothing is written without it.
* ``--quiet``: no progress on stderr.
* ``--trace`` / ``--cluster`` (``simulate``, ``sweep``): a trace needs the cluster it is
  replayed on; without ``--cluster`` the command refuses (exit 2) rather than silently using
  its built-in demo cluster, which ``--cluster builtin`` selects on purpose
  (:func:`trace_needs_cluster`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

__all__ = [
    "BUILTIN_CLUSTER",
    "DeprecatedAlias",
    "add_catalog_argument",
    "catalog_files",
    "deprecated_alias",
    "trace_needs_cluster",
]

BUILTIN_CLUSTER = "builtin"
"""``--cluster builtin``: the command's built-in cluster, chosen on purpose."""


class DeprecatedAlias(argparse.Action):
    """A deprecated spelling of an option: stores its value (``const`` when it takes none),
    appends it when ``append``, and notes the new spelling ``new`` on stderr."""

    def __init__(self, *args: Any, new: str = "", append: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.new, self.append = new, append

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(f"{parser.prog}: note: {option_string} is deprecated; use {self.new}",
              file=sys.stderr)  # fmt: skip
        value = self.const if self.nargs == 0 else values
        if self.append:
            value = [*(getattr(namespace, self.dest, None) or []), value]
        setattr(namespace, self.dest, value)


def deprecated_alias(
    parser: argparse.ArgumentParser,
    old: str,
    new: str,
    dest: str,
    *,
    append: bool = False,
    type: Any = None,
) -> None:
    """Accept ``old`` as a hidden spelling of ``new`` (same ``dest`` and ``type``), with a note
    on use."""
    parser.add_argument(
        old,
        dest=dest,
        action=DeprecatedAlias,
        new=new,
        append=append,
        type=type,
        help=argparse.SUPPRESS,
    )


def add_catalog_argument(
    parser: argparse.ArgumentParser, *, old: Sequence[str] = (), env: str = ""
) -> None:
    """``--catalog FILE`` (repeatable, comma lists too); ``old``: hidden deprecated spellings;
    ``env``: how the flag combines with the environment, for the help."""
    parser.add_argument(
        "--catalog",
        action="append",
        default=[],
        metavar="FILE",
        help="GPU catalog override file, JSON or YAML (repeatable or comma-separated)"
        + (f"; {env}" if env else ""),
    )
    for name in old:
        deprecated_alias(parser, name, "--catalog", "catalog", append=True)


def catalog_files(values: Sequence[str] | None) -> list[str]:
    """The files of every ``--catalog`` value, comma lists split, in the order given."""
    return [f.strip() for v in values or () for f in v.split(",") if f.strip()]


def trace_needs_cluster(command: str, trace: str | None, cluster: str | None) -> None:
    """:class:`~gpuslice.cli.BadInput` when a trace is given without a cluster to run it on."""
    from gpuslice.cli import BadInput

    if trace and not cluster:
        raise BadInput(
            f"--trace {trace} needs --cluster: give the cluster the workload runs on (a "
            f"cluster YAML/JSON file, or 'openb' for the openb traces), or --cluster "
            f"{BUILTIN_CLUSTER} to run it on the built-in demo cluster on purpose "
            f"(see gpuslice {command} --help)"
        )


def pod_refs(refs: Sequence[str], namespace: str | None) -> list[tuple[str, str]]:
    """``(namespace, name)`` of each ``NAME`` (in ``namespace``, else ``default``) or
    ``NAMESPACE/NAME``; :class:`~gpuslice.cli.BadInput` for a malformed one or one outside
    ``--namespace``."""
    from gpuslice.cli import BadInput

    out = []
    for ref in refs:
        ns, sep, name = ref.rpartition("/")
        if (sep and not ns) or not name or "/" in ns:
            raise BadInput(f"pod {ref!r}: expected NAME or NAMESPACE/NAME")
        if sep and namespace and ns != namespace:
            raise BadInput(f"pod {ref!r} is not in --namespace {namespace}")
        out.append((ns or namespace or "default", name))
    return out
