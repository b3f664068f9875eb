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
* Numbers: every numeric option is finite and in a range its help states, checked before any
  work (:func:`number`, :func:`integer`, :func:`numbers` as argparse types; :func:`check_number`
  where a command checks in ``run``).  A huge value that would only make the command run for
  ever has an upper bound too.
* ``--out DIR`` is made (or refused, exit 2) before the work starts, so that a typo does not
  lose a long run's results at the end (:func:`out_folder`).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from planner.settings import MAX_SEED, MAX_TIME_LIMIT_S
from simulations.inputs.limits import in_range

__all__ = [
    "BUILTIN_CLUSTER",
    "DAY_S",
    "MAX_SEED",
    "MAX_TIME_LIMIT_S",
    "DeprecatedAlias",
    "add_catalog_argument",
    "catalog_files",
    "check_number",
    "deprecated_alias",
    "integer",
    "number",
    "numbers",
    "out_folder",
    "range_text",
    "settings_problems",
    "trace_needs_cluster",
]

BUILTIN_CLUSTER = "builtin"
"""``--cluster builtin``: the command's built-in cluster, chosen on purpose."""

DAY_S = 86400.0
"""The upper bound of the simulated-time options in seconds (batch window, retry, apply
delay): a day, far beyond any setting worth trying."""


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


def _text(x: float) -> str:
    """``86400``, ``1000000``, ``0.001``, ``inf``: no exponent for a whole number."""
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e16:
        return str(int(x))
    return str(x) if isinstance(x, int) else f"{x:g}"


def range_text(low: float, high: float, *, above: bool = False, unit: str = "") -> str:
    """``from 0 to 86400 s``, ``positive and at most 3600 s``, ``above 0.5 and at most 2``."""
    if above:
        start = "positive" if low == 0 else f"above {_text(low)}"
        return f"{start} and at most {_text(high)}{unit}"
    return f"from {_text(low)} to {_text(high)}{unit}"


def check_number(
    option: str, value: float, low: float, high: float, *, above: bool = False, unit: str = ""
) -> None:
    """:class:`~gpuslice.cli.BadInput` naming ``option`` unless ``value`` is finite and from
    ``low`` (excluded when ``above``) to ``high``."""
    from gpuslice.cli import BadInput

    if not in_range(value, low, high, above=above):
        raise BadInput(
            f"{option} must be {range_text(low, high, above=above, unit=unit)}, got {_text(value)}"
        )


def number(
    low: float, high: float, *, above: bool = False, unit: str = ""
) -> Callable[[str], float]:
    """An argparse ``type``: a finite number from ``low`` (excluded when ``above``) to
    ``high``; anything else (``nan``, ``inf``, out of range) is a usage error naming the
    option and the range (exit 2)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not in_range(value, low, high, above=above):
            raise argparse.ArgumentTypeError(
                f"must be a number {range_text(low, high, above=above, unit=unit)}, got {text!r}"
            )
        return value

    return parse


def numbers(
    low: float, high: float, *, above: bool = False, unit: str = ""
) -> Callable[[str], list[float]]:
    """An argparse ``type``: comma-separated numbers, each as :func:`number` takes it."""
    one = number(low, high, above=above, unit=unit)

    def parse(text: str) -> list[float]:
        values = [x.strip() for x in text.split(",") if x.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
        try:
            return [one(x) for x in values]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"must be comma-separated numbers, each "
                f"{range_text(low, high, above=above, unit=unit)}, got {text!r}"
            ) from None

    return parse


def integer(low: int, high: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number from ``low`` to ``high`` (else a usage error naming
    the option and the range, exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high}, got {text!r}")
        return value

    return parse


def out_folder(
    value: str | None, writes: Sequence[str] = (), *, given: str | None = None
) -> Path | None:
    """The folder ``--out DIR`` names, made now -- before the work, so that a typo cannot lose
    a long run's results when it ends -- or :class:`~gpuslice.cli.BadInput` naming ``--out``
    and the fix (exit 2).  ``writes``: what the command will write there, relative to ``DIR``
    (a name ending in ``/`` is a sub-folder, made too); each file must not be a folder, nor an
    unwritable file.  ``given``: the ``--out`` value to name, where ``value`` was derived from
    it (the folder of a deprecated ``--out FILE``).  ``None`` without ``--out``."""
    from gpuslice.cli import BadInput

    if not value:
        return None
    root = Path(value)
    tops = dict.fromkeys(w.split("/", 1)[0] + ("/" if "/" in w else "") for w in writes)
    gets = f" (it gets {', '.join(tops)})" if tops else ""

    def refuse(problem: str) -> BadInput:
        return BadInput(f"--out {given or value}: {problem}; give a folder you can write{gets}")

    files = [root / w for w in writes if not w.endswith("/")]
    folders = [root, *(root / w for w in writes if w.endswith("/")), *(f.parent for f in files)]
    for folder in dict.fromkeys(folders):
        nearest = next((p for p in (folder, *folder.parents) if p.exists()), None)
        if nearest is not None and not nearest.is_dir():
            raise refuse(f"{nearest} is a file, not a folder")
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise refuse(f"cannot create the folder {folder} ({e.strerror or e})") from None
        if not os.access(folder, os.W_OK | os.X_OK):
            raise refuse(f"the folder {folder} is not writable")
    for file in files:
        if file.is_dir():
            raise refuse(f"{file} is a folder, where a file is to be written")
        if file.exists() and not os.access(file, os.W_OK):
            raise refuse(f"{file} is not writable")
    return root


def settings_problems(
    errors: Sequence[Any],
    renamed: Mapping[str, str],
    flags: Callable[[str], str | None] = lambda name: None,
) -> str:
    """A settings class's validation errors (pydantic's ``ValidationError.errors()``) as one
    line, each naming the setting, its flag (``flags``: the field's flag, or ``None``) and its
    environment variable (with a deprecated name still set, ``renamed``: old -> field)."""
    out = []
    for err in errors:
        loc, msg = tuple(err["loc"]), str(err["msg"])
        if not loc:
            out.append(msg)
            continue
        name = str(loc[0])
        old = [o for o, f in renamed.items() if f == name and o in os.environ]
        env = " or ".join([f"GPUSLICE_{name.upper()}", *(f"{o} (deprecated)" for o in old)])
        flag = flags(name)
        where = f"{flag} or {env}" if flag else env
        item = "".join(f"[{part}]" for part in loc[1:])
        out.append(f"{name}{item} ({where}): {msg}")
    return "; ".join(out)
