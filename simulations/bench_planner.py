"""Planner benchmark: the CP-SAT planner against the nos-like greedy on the same instances.

What it measures
----------------
For each cluster size (default 10, 100 and 1000 nodes x 8 A100-80GB) it generates seeded
instances with :func:`simulations.inputs.instances.mig_benchmark_snapshot` (85 % of the compute
slices held by used instances, a pending batch of 30 % of the GPU count) and runs, on each
instance, ``planner.api.plan`` with policy ``cpsat`` and with policy ``greedy``.  Per planner
and size it reports:

* ``solve_s``: wall time of the whole ``plan()`` call (validation, eligibility, warm start,
  model build, solve, decode), measured here with ``time.perf_counter`` since the planner
  reads no clock; p50 and p99 by the nearest-rank method (with fewer than 100 instances p99
  is the maximum), and the maximum;
* ``cpu_s``: CPU time of this process during the same call (``time.process_time``), the same
  summary.  On a shared machine wall time exceeds CPU time by the time other processes held
  the cores, so both are reported, with the load average before and after the run
  (``machine.loadavg_start``/``loadavg_end``, 1/5/15-minute, ``null`` where unavailable);
* ``per_plan``: each call's ``wall_s`` and ``cpu_s`` with the 1-minute load average just
  before it (``loadavg_1m``), and for CP-SAT the rounds it ran and skipped for time;
  ``over_limit_10pct``: calls whose wall time exceeded the time limit by more than 10 %;
* ``unplaced_eligible``: pods left unplaced although some node was eligible for them
  (reason ``capacity`` or ``node cpu/memory``): what a better plan could still place;
* ``placed``: pods placed, and ``placed_weight``: the CP-SAT objective's first level
  (:func:`planner.demand.pod_weights` without waiting tiers: priorities, then compute placed
  or pods placed per ``placement_weight``);
* ``churn``: instances created and destroyed, GPUs touched, and the weighted churn
  ``w_destroy * destroyed + w_create * created + w_gpu_touched * gpus_touched``, all computed
  here from the snapshot and the plan, the same way for both planners;
* for CP-SAT, the optimality gap from the solver's objective bound: ``objective_gap`` is
  ``Plan.stats['gap']`` (the whole lexicographic objective) and ``placed_weight_gap`` is
  ``1 - placed_weight / stats['placed_weight_bound']`` (pods only); ``null`` where the plan
  fell back to greedy and has no bound; and the solver statuses seen.

``cpsat_ge_greedy`` says per size (and overall) whether CP-SAT placed at least the greedy's
priority-weighted pods on every instance.  One JSON document goes to stdout (or ``--out``);
progress goes to stderr.  Run ``python -m simulations.bench_planner --help``;
``gpuslice bench planner`` runs the same with a table by default (``-o json`` for the document,
``--out DIR`` to keep it as ``DIR/planner.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from planner.api import plan
from planner.catalog import Catalog, default_catalog
from planner.demand import pod_weights
from planner.settings import MAX_SEED, MAX_TIME_LIMIT_S, PlannerSettings, Policy
from planner.snapshot import Mode, Plan, Snapshot, Unplaced
from simulations.inputs.instances import mig_benchmark_snapshot
from simulations.inputs.limits import in_range
from simulations.reports.out_file import out_file_error

__all__ = [
    "add_arguments",
    "check_args",
    "main",
    "percentile",
    "plan_churn",
    "run",
    "run_benchmark",
    "unplaced_eligible",
]

DEFAULT_SIZES = (10, 100, 1000)
DEFAULT_INSTANCES = {10: 5, 100: 5, 1000: 3}

# Upper bounds of the options (in their help): a larger value would only run for hours or
# exhaust memory; planner limits as in planner.settings.
MAX_NODES = 10_000
"""Most nodes of one ``--sizes`` entry."""
MAX_INSTANCES = 100
"""Most seeded instances per size (``--instances``)."""
MAX_WORKERS = 256
"""Most CP-SAT search workers (``--workers``)."""
MAX_GPUS_PER_NODE = 16
"""Most GPUs per node (``--gpus-per-node``)."""
MAX_PENDING_FRACTION = 10.0
"""Largest pending batch, in pods per GPU (``--pending-fraction``)."""


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty sequence."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def plan_churn(
    snapshot: Snapshot, result: Plan, settings: PlannerSettings, catalog: Catalog
) -> dict[str, int]:
    """Instances created/destroyed and GPUs touched by ``result``, and the weighted churn."""
    created = destroyed = touched = 0
    nodes = {n.name: n for n in snapshot.nodes}
    for (node_name, index), planned in result.layouts.items():
        node = nodes[node_name]
        gpu = next(g for g in node.gpus if g.index == index)
        if node.mode is Mode.MPS:
            before = Counter(("mps", s.memory_mib) for s in gpu.mps)
            after = Counter(("mps", s.memory_mib) for s in planned.mps)
        else:
            model = catalog.model(node.model)
            before = Counter((model.profile(i.profile).name, i.start) for i in gpu.mig)
            after = Counter((model.profile(p).name, s) for p, s in planned.mig)
        if before == after:
            continue
        touched += 1
        created += (after - before).total()
        destroyed += (before - after).total()
    weighted = (
        settings.weight_destroy * destroyed
        + settings.weight_create * created
        + settings.weight_gpu_touched * touched
    )
    return {
        "instances_created": created,
        "instances_destroyed": destroyed,
        "gpus_touched": touched,
        "weighted": weighted,
    }


def _placed_weight(snapshot: Snapshot, result: Plan, settings: PlannerSettings) -> int:
    weights = pod_weights(snapshot.pods, (), settings.placement_weight)
    return sum(weights[name] for name in result.assignments)


def _run_one(
    snapshot: Snapshot, settings: PlannerSettings, catalog: Catalog
) -> tuple[Plan, float, float]:
    """The plan, the call's wall seconds and its CPU seconds."""
    cpu, wall = time.process_time(), time.perf_counter()
    result = plan(snapshot, settings, catalog)
    return result, time.perf_counter() - wall, time.process_time() - cpu


_ROOM_REASONS = (Unplaced.CAPACITY.value, Unplaced.NODE_RESOURCES.value)


def unplaced_eligible(result: Plan) -> int:
    """Unplaced pods whose reason says an eligible node existed (capacity, node cpu/memory)."""
    return sum(1 for reason in result.unplaced.values() if reason.startswith(_ROOM_REASONS))


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not available on this platform
        return None


def machine_info(load_start: list[float] | None) -> dict[str, Any]:
    """The ``machine`` part of a benchmark document: CPUs, Python, platform, load average at
    the start (``load_start``) and now."""
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_start": load_start,
        "loadavg_end": loadavg(),
    }


def _summary(values: Sequence[float]) -> dict[str, float]:
    return {
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "max": max(values),
        "mean": sum(values) / len(values),
    }


def run_benchmark(
    sizes: Sequence[int] = DEFAULT_SIZES,
    instances: Sequence[int] | None = None,
    *,
    time_limit_s: float = 1.0,
    seed: int = 0,
    num_workers: int = 1,
    gpus_per_node: int = 8,
    occupancy: float = 0.85,
    pending_fraction: float = 0.30,
    model_name: str = "A100-SXM4-80GB",
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Run the benchmark (module docstring) and return the JSON-ready result."""
    counts = (
        list(instances) if instances is not None else [DEFAULT_INSTANCES.get(n, 3) for n in sizes]
    )
    if len(counts) != len(sizes):
        raise ValueError(f"{len(sizes)} sizes but {len(counts)} instance counts")
    catalog = default_catalog()
    base = PlannerSettings(time_limit_s=time_limit_s, seed=seed, num_workers=num_workers)
    load_start = loadavg()
    policies = {
        "cpsat": replace(base, policy=Policy.CPSAT),
        "greedy": replace(base, policy=Policy.GREEDY),
    }
    results: list[dict[str, Any]] = []
    for nodes, count in zip(sizes, counts, strict=True):
        rows: list[dict[str, Any]] = []
        for i in range(count):
            inst_seed = seed * 1_000_003 + nodes * 101 + i
            snapshot = mig_benchmark_snapshot(
                nodes,
                gpus_per_node=gpus_per_node,
                occupancy=occupancy,
                pending_fraction=pending_fraction,
                seed=inst_seed,
                model_name=model_name,
                catalog=catalog,
            )
            row: dict[str, Any] = {"instance_seed": inst_seed, "pending_pods": len(snapshot.pods)}
            for name, settings in policies.items():
                load = loadavg()
                result, seconds, cpu_seconds = _run_one(snapshot, settings, catalog)
                stats = result.stats
                entry: dict[str, Any] = {
                    "solve_s": seconds,
                    "cpu_s": cpu_seconds,
                    "loadavg_1m": None if load is None else load[0],
                    "status": result.status,
                    "placed": len(result.assignments),
                    "unplaced_eligible": unplaced_eligible(result),
                    "placed_weight": _placed_weight(snapshot, result, settings),
                    "churn": plan_churn(snapshot, result, settings, catalog),
                }
                if name == "cpsat":
                    entry["rounds"] = int(stats.get("rounds", 0))
                    entry["rounds_skipped"] = int(stats.get("rounds_skipped", 0))
                    bound = stats.get("placed_weight_bound")
                    entry["objective_gap"] = stats.get("gap")
                    entry["placed_weight_gap"] = (
                        None
                        if bound is None or bound <= 0
                        else max(0.0, 1.0 - entry["placed_weight"] / bound)
                    )
                row[name] = entry
            row["cpsat_ge_greedy"] = row["cpsat"]["placed_weight"] >= row["greedy"]["placed_weight"]
            progress(
                f"{nodes} nodes, instance {i + 1}/{count}: "
                f"cpsat {row['cpsat']['placed']} placed in {row['cpsat']['solve_s']:.2f}s "
                f"(cpu {row['cpsat']['cpu_s']:.2f}s, {row['cpsat']['status']}), greedy "
                f"{row['greedy']['placed']} placed in {row['greedy']['solve_s']:.2f}s "
                f"(cpu {row['greedy']['cpu_s']:.2f}s)"
            )
            rows.append(row)
        results.append(_size_summary(nodes, gpus_per_node, rows, time_limit_s))
    return {
        "benchmark": "planner",
        "gpu_model": model_name,
        "gpus_per_node": gpus_per_node,
        "occupancy": occupancy,
        "pending_fraction": pending_fraction,
        "time_limit_s": time_limit_s,
        "seed": seed,
        "num_workers": num_workers,
        "machine": machine_info(load_start),
        "sizes": results,
        "cpsat_ge_greedy_everywhere": all(r["cpsat_ge_greedy"] for r in results),
    }


def _size_summary(
    nodes: int, gpus_per_node: int, rows: list[dict[str, Any]], time_limit_s: float
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "nodes": nodes,
        "gpus": nodes * gpus_per_node,
        "instances": len(rows),
        "pending_pods": [r["pending_pods"] for r in rows],
    }
    for name in ("cpsat", "greedy"):
        entries = [r[name] for r in rows]
        summary: dict[str, Any] = {
            "solve_s": _summary([e["solve_s"] for e in entries]),
            "cpu_s": _summary([e["cpu_s"] for e in entries]),
            "placed": [e["placed"] for e in entries],
            "unplaced_eligible": [e["unplaced_eligible"] for e in entries],
            "placed_weight": [e["placed_weight"] for e in entries],
            "churn_weighted": [e["churn"]["weighted"] for e in entries],
            "churn": [e["churn"] for e in entries],
            "status": dict(Counter(e["status"] for e in entries)),
            "over_limit_10pct": sum(1 for e in entries if e["solve_s"] > 1.1 * time_limit_s),
            "per_plan": [
                {
                    "wall_s": round(e["solve_s"], 4),
                    "cpu_s": round(e["cpu_s"], 4),
                    "loadavg_1m": e["loadavg_1m"],
                    **(
                        {"rounds": e["rounds"], "rounds_skipped": e["rounds_skipped"]}
                        if name == "cpsat"
                        else {}
                    ),
                }
                for e in entries
            ],
        }
        if name == "cpsat":
            for key in ("objective_gap", "placed_weight_gap"):
                gaps = [e[key] for e in entries if e[key] is not None]
                summary[key] = _summary(gaps) if gaps else None
        out[name] = summary
    out["cpsat_ge_greedy"] = all(r["cpsat_ge_greedy"] for r in rows)
    out["per_instance_cpsat_ge_greedy"] = [r["cpsat_ge_greedy"] for r in rows]
    return out


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes",
        type=_int_list,
        default=list(DEFAULT_SIZES),
        help=f"comma-separated node counts, each 1 to {MAX_NODES} (default: 10,100,1000)",
    )
    parser.add_argument(
        "--instances",
        type=_int_list,
        default=None,
        help="seeded instances per size: one number for all sizes, or one per size, each 1 to "
        f"{MAX_INSTANCES} (default: 5 at 10 and 100 nodes, 3 at 1000)",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=1.0,
        help=f"CP-SAT time limit per plan, seconds (above 0, at most {MAX_TIME_LIMIT_S:g}; "
        "default 1)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help=f"instance and solver seed (0 to {MAX_SEED})"
    )
    parser.add_argument(
        "--workers", type=int, default=1, help=f"CP-SAT search workers (1 to {MAX_WORKERS})"
    )
    parser.add_argument(
        "--gpus-per-node", type=int, default=8, help=f"1 to {MAX_GPUS_PER_NODE} (default 8)"
    )
    parser.add_argument(
        "--occupancy",
        type=float,
        default=0.85,
        help="share of the compute slices held by used instances, 0 to 1 (default 0.85)",
    )
    parser.add_argument(
        "--pending-fraction",
        type=float,
        default=0.30,
        help=f"pending pods per GPU, 0 to {MAX_PENDING_FRACTION:g} (default 0.3)",
    )


def check_args(args: argparse.Namespace) -> list[int] | None:
    """Validate parsed options; return the per-size instance counts. ``ValueError`` if bad."""
    sizes: list[int] = args.sizes
    instances: list[int] | None = args.instances
    if instances is not None and len(instances) == 1:
        instances = instances * len(sizes)
    if instances is not None and len(instances) != len(sizes):
        raise ValueError(
            f"--instances has {len(instances)} values for {len(sizes)} sizes; "
            "give one number, or one per size"
        )
    if max(sizes) > MAX_NODES:
        raise ValueError(f"--sizes must be at most {MAX_NODES} nodes each, got {max(sizes)}")
    if instances is not None and max(instances) > MAX_INSTANCES:
        raise ValueError(
            f"--instances must be at most {MAX_INSTANCES} per size, got {max(instances)}"
        )
    if not in_range(args.time_limit, 0, MAX_TIME_LIMIT_S, above=True):
        raise ValueError(
            f"--time-limit must be positive and at most {MAX_TIME_LIMIT_S:g} s, "
            f"got {args.time_limit:g}"
        )
    if not 0 <= args.seed <= MAX_SEED:
        raise ValueError(f"--seed must be from 0 to {MAX_SEED}, got {args.seed}")
    if not 1 <= args.workers <= MAX_WORKERS:
        raise ValueError(f"--workers must be from 1 to {MAX_WORKERS}, got {args.workers}")
    if not 1 <= args.gpus_per_node <= MAX_GPUS_PER_NODE:
        raise ValueError(
            f"--gpus-per-node must be from 1 to {MAX_GPUS_PER_NODE}, got {args.gpus_per_node}"
        )
    if not in_range(args.occupancy, 0.0, 1.0):
        raise ValueError(f"--occupancy must be between 0 and 1, got {args.occupancy:g}")
    if not in_range(args.pending_fraction, 0.0, MAX_PENDING_FRACTION):
        raise ValueError(
            f"--pending-fraction must be from 0 to {MAX_PENDING_FRACTION:g} (pending pods per "
            f"GPU), got {args.pending_fraction:g}"
        )
    return instances


def run_args(
    args: argparse.Namespace, instances: list[int] | None, progress: Callable[[str], None]
) -> dict[str, Any]:
    """:func:`run_benchmark` with validated options (:func:`check_args`): the document."""
    return run_benchmark(
        args.sizes,
        instances,
        time_limit_s=args.time_limit,
        seed=args.seed,
        num_workers=args.workers,
        gpus_per_node=args.gpus_per_node,
        occupancy=args.occupancy,
        pending_fraction=args.pending_fraction,
        progress=progress,
    )


def run(args: argparse.Namespace, instances: list[int] | None) -> int:
    """Run with validated options (:func:`check_args`) and print or write the JSON."""
    result = run_args(args, instances, lambda line: print(line, file=sys.stderr, flush=True))
    emit_document(result, args.out)
    return 0


def emit_document(doc: Any, out: str | None) -> None:
    """A benchmark's JSON document: to the file ``out`` (and "wrote <file>" on stderr) or to
    stdout (the ``python -m simulations.bench_*`` commands)."""
    text = json.dumps(doc, indent=2)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
        print(f"wrote {out}", file=sys.stderr)
    else:
        print(text)


def parse_bench_args[T](
    module: str,
    doc: str | None,
    add: Callable[[argparse.ArgumentParser], None],
    check: Callable[[argparse.Namespace], T],
    argv: Sequence[str] | None,
) -> tuple[argparse.Namespace, T]:
    """``python -m simulations.<module>``'s options (``add``, plus ``--out``) and what ``check``
    makes of them; a ``ValueError`` from ``check`` is a usage error (exit status 2)."""
    parser = argparse.ArgumentParser(
        prog=f"python -m simulations.{module}", description=(doc or "").splitlines()[0]
    )
    add(parser)
    parser.add_argument("--out", default=None, help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)
    problem = out_file_error("--out", args.out)
    if problem:
        parser.error(problem)  # before the run, which may take minutes (exit status 2)
    try:
        return args, check(args)
    except ValueError as e:
        parser.error(str(e))  # exits with status 2


def main(argv: Sequence[str] | None = None) -> int:
    args, instances = parse_bench_args("bench_planner", __doc__, add_arguments, check_args, argv)
    return run(args, instances)


if __name__ == "__main__":
    sys.exit(main())
