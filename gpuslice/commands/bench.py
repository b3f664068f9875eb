"""``gpuslice bench planner``: the planner benchmark (:mod:`simulations.bench_planner`)."""

from __future__ import annotations

import argparse

from gpuslice.cli import BadInput

HELP = "run a benchmark: 'planner' compares the CP-SAT planner with the greedy baseline"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from simulations import bench_planner

    parser.add_argument("target", choices=["planner"], help="what to benchmark")
    bench_planner.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from simulations import bench_planner

    try:
        instances = bench_planner.check_args(args)
    except ValueError as e:
        raise BadInput(str(e)) from e
    return bench_planner.run(args, instances)
