"""gpuslice: repartition NVIDIA GPUs (MIG and MPS) in Kubernetes on demand.

One console script, one subcommand per job.

Each subcommand lives in ``gpuslice/commands/<name>.py`` and exposes ``HELP`` (one line),
``add_arguments(parser)`` and ``run(args) -> int``.  Modules are imported only when their
subcommand runs, so ``gpuslice plan`` never imports kopf or grpc.

Exit codes: 0 success, 1 runtime failure, 2 bad input (the message names the object and the fix).

Conventions every subcommand keeps (:mod:`gpuslice.output`, :mod:`gpuslice.options`,
:mod:`gpuslice.progress`): results on stdout as a table, or ``-o wide|json|yaml``; progress and
notes on stderr, drawn as a bar only on a terminal; files only under ``--out DIR``; one flag
name per concept (``--catalog``, ``--snapshot``, ``--out``, ``--quiet``).
``gpuslice --version`` prints ``gpuslice <version>``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": (
        "gpuslice.commands.plan",
        "plan a pending batch (built-in demo or a kubectl snapshot)",
    ),
    "bench": ("gpuslice.commands.bench", "run a benchmark (planner, controller)"),
    "simulate": (
        "gpuslice.commands.simulate",
        "what-if simulator (default: built-in workload and cluster)",
    ),
    "sweep": (
        "gpuslice.commands.sweep",
        "tune batch timeout/idle and planner weights with the time replay",
    ),
    "export": ("gpuslice.commands.export", "workload file from your cluster's pods, for what-if"),
    "nos-check": (
        "gpuslice.commands.nos_check",
        "list the pods and nodes whose meaning changes when gpuslice replaces nos",
    ),
    "partitioner": ("gpuslice.commands.partitioner", "run the partitioner controller (kopf)"),
    "agent": ("gpuslice.commands.agent", "run the node agent (use --fake without a GPU)"),
    "status": (
        "gpuslice.commands.status",
        "where every pod waiting for a slice stands, and every gpuslice node (read-only)",
    ),
    "ungate": (
        "gpuslice.commands.ungate",
        "release pods from gpuslice's scheduling gate (uninstall, partitioner down)",
    ),
}

EXIT_BAD_INPUT = 2


class BadInput(Exception):
    """Raised by a subcommand for invalid user input: printed, exit code 2."""


def version() -> str:
    """The installed package's version (its metadata), or ``unknown`` outside an install."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("gpuslice")
    except PackageNotFoundError:
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpuslice", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--version", action="version", version=f"gpuslice {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_BAD_INPUT
    module = importlib.import_module(COMMANDS[args.command][0])
    cmd_parser = argparse.ArgumentParser(prog=f"gpuslice {args.command}", description=module.HELP)
    module.add_arguments(cmd_parser)
    cmd_args = cmd_parser.parse_args(rest)
    try:
        from gpuslice.extras import require_extra

        require_extra(args.command)  # e.g. simulate needs gpuslice[sim]: exit 2, not a traceback
        return int(module.run(cmd_args))
    except BadInput as e:
        print(f"gpuslice {args.command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `gpuslice plan --demo | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
