"""``gpuslice simulate``: the what-if simulator.

With no arguments it runs the built-in synthetic workload (``simulations/data/
default_workload.yaml``) on the built-in cluster (``simulations/data/default_cluster.yaml``)
through the saturation protocol for BestFit, FGD and gpuslice over seeds 42-51, then the time-replay
protocol on the built-in MIG scenario (CP-SAT vs nos-like greedy vs a static layout), shows a
progress bar on stderr and prints both comparison tables.  Nothing outside the package is read.

``--trace`` takes an openb trace name (``default``, ``gpushare40`` ...; the folder comes from
``--openb-dir``, ``$GPUSLICE_OPENB_DIR`` or ``../shared/traces/openb``), an openb pod CSV, or a
workload YAML/JSON file (:mod:`simulations.workload`).  ``--cluster`` takes ``openb`` or a cluster
YAML/JSON file (:mod:`simulations.cluster`).  ``--out DIR`` writes ``report.md``,
``allocation.png`` and ``results.json``.

Protocols are looked up in :data:`PROTOCOLS` (name -> runner); another protocol plugs in by
adding an entry whose runner takes ``(args, cluster, workload, progress)`` and returns the exit
code.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import simulations.workload
from gpuslice.cli import BadInput
from simulations.bench_saturation import aggregate, format_table, write_report
from simulations.cluster import Cluster, ClusterError, load_cluster
from simulations.openb import load_openb_pods, resolve_trace
from simulations.policies import POLICIES
from simulations.saturation import SaturationResult, run_saturation
from simulations.workload import Workload, WorkloadError, load_workload

HELP = "what-if simulator (default: built-in synthetic workload on a built-in cluster)"

DEFAULT_SEED = 42
DEFAULT_REPEATS = 10


class ProgressBar:
    """A one-line text progress bar on a stream (stderr), redrawn at most every 0.1 s."""

    def __init__(
        self, total: int, label: str = "", stream: TextIO | None = None, width: int = 30
    ) -> None:
        self.total = max(1, total)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.done = 0
        self._last = 0.0
        self._started = time.perf_counter()

    def update(self, done: int, label: str | None = None) -> None:
        self.done = min(done, self.total)
        if label is not None:
            self.label = label
        now = time.perf_counter()
        if now - self._last >= 0.1 or self.done == self.total:
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = self.done / self.total
        filled = round(frac * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(
            f"\r[{bar}] {100 * frac:5.1f}% {now - self._started:5.1f}s {self.label:<32.32}"
        )
        self.stream.flush()

    def close(self) -> None:
        self.update(self.total)
        self.stream.write("\n")
        self.stream.flush()


class _Silent(ProgressBar):
    def _draw(self, now: float) -> None:
        pass

    def close(self) -> None:
        pass


ProtocolRunner = Callable[[argparse.Namespace, Cluster, Workload, ProgressBar], int]


def _run_saturation_protocol(
    args: argparse.Namespace, cluster: Cluster, workload: Workload, bar: ProgressBar
) -> int:
    policies = _policies(args.policy)
    seeds = list(range(args.seed, args.seed + args.repeats))
    runs = [(p, s) for p in policies for s in seeds]
    bar.total = len(runs) * 1000
    results: list[SaturationResult] = []
    for i, (policy, seed) in enumerate(runs):

        def progress(
            done: int, total: int, i: int = i, policy: str = policy, seed: int = seed
        ) -> None:
            bar.update(i * 1000 + (1000 * done) // max(1, total), f"{policy} seed {seed}")

        try:
            results.append(
                run_saturation(cluster, workload, policy, seed, batch=args.batch, progress=progress)
            )
        except ValueError as e:
            raise BadInput(str(e)) from None
    bar.close()
    summary = aggregate(results)
    print(
        f"saturation protocol: {workload.name} ({len(workload)} pods) on {cluster.name}: "
        f"{cluster.summary()}; seeds {seeds[0]}-{seeds[-1]}, batch k={args.batch}"
    )
    print(format_table(summary))
    if args.out:
        setup = {
            "title": f"Saturation protocol: {workload.name} on {cluster.name}",
            "protocol": "saturation",
            "workload": f"{workload.name} ({len(workload)} pods, {workload.source})",
            "cluster": f"{cluster.name}: {cluster.summary()}",
            "seeds": f"{seeds[0]}-{seeds[-1]}",
            "batch": args.batch,
            "policies": ", ".join(policies),
            "date": time.strftime("%Y-%m-%d"),
        }
        for path in write_report(Path(args.out), results, setup):
            print(f"wrote {path}")
    return 0


def _run_time_replay_protocol(
    args: argparse.Namespace, cluster: Cluster, workload: Workload, bar: ProgressBar
) -> int:
    """Time replay (simulations.replay_protocol); no --trace/--cluster: its built-in MIG scenario."""
    from simulations.replay import ReplayError, ReplaySettings
    from simulations.replay_protocol import builtin_scenario, run_replay_protocol

    if args.trace is None and args.cluster is None:
        workload, cluster = builtin_scenario()
    bar.total = 1000

    def progress(done: int, total: int, label: str) -> None:
        bar.update(1000 * done // max(1, total), label)

    try:
        text, _ = run_replay_protocol(
            workload, cluster, args.policy, ReplaySettings(seed=args.seed), args.out, progress
        )
    except (ReplayError, ValueError) as e:
        raise BadInput(str(e)) from None
    bar.close()
    print(text)
    return 0


def _run_both_protocols(
    args: argparse.Namespace, cluster: Cluster, workload: Workload, bar: ProgressBar
) -> int:
    """Saturation (GPU-share placement policies), then time replay (MIG partitioning policies).

    With ``--out DIR`` each protocol writes into its own sub-folder of ``DIR``.
    """
    out = args.out
    for name, runner in (
        ("saturation", _run_saturation_protocol),
        ("time-replay", _run_time_replay_protocol),
    ):
        sub = argparse.Namespace(**{**vars(args), "out": str(Path(out) / name) if out else None})
        if name == "time-replay":
            print()
            sub.policy = None  # the replay compares partitioning policies, not placement ones
            bar = type(bar)(1)
        code = runner(sub, cluster, workload, bar)
        if code:
            return code
    return 0


PROTOCOLS: dict[str, ProtocolRunner] = {
    "saturation": _run_saturation_protocol,
    "time-replay": _run_time_replay_protocol,
    "both": _run_both_protocols,
}
"""Protocol name -> runner. Add entries here to offer more protocols."""


def _policies(spec: str | None) -> list[str]:
    if not spec:
        return list(POLICIES)
    names = [p.strip().lower() for p in spec.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICIES]
    if unknown or not names:
        raise BadInput(
            f"--policy {spec!r}: unknown {unknown}; choose from {', '.join(POLICIES)} (comma-separated)"
        )
    return names


def _builtin(name: str) -> Path:
    """A file of the package data ``simulations/data``."""
    return Path(simulations.workload.__file__).parent / "data" / name


def _load_workload(spec: str | None, openb_directory: str | None) -> Workload:
    try:
        if spec is None:
            return load_workload(_builtin("default_workload.yaml"))
        p = Path(spec)
        if p.suffix.lower() in (".yaml", ".yml", ".json"):
            return load_workload(p)
        return load_openb_pods(resolve_trace(spec, openb_directory))
    except WorkloadError as e:
        raise BadInput(str(e)) from None


def _load_cluster(spec: str | None, openb_directory: str | None) -> Cluster:
    try:
        if spec is None:
            return load_cluster(str(_builtin("default_cluster.yaml")))
        return load_cluster(spec, openb_directory)
    except (ClusterError, WorkloadError) as e:
        raise BadInput(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace",
        help="openb trace name (default, gpushare40, ...), openb pod CSV, or workload YAML/JSON (default: built-in synthetic)",
    )
    parser.add_argument("--cluster", help="'openb' or a cluster YAML/JSON file (default: built-in)")
    parser.add_argument(
        "--policy", help=f"comma-separated policies (default: {','.join(POLICIES)})"
    )
    parser.add_argument(
        "--protocol",
        default=None,
        choices=sorted(PROTOCOLS),
        help="simulation protocol (default: both on the built-in workload and cluster, "
        "saturation when --trace or --cluster is given)",
    )
    parser.add_argument(
        "--seed", type=int, default=DEFAULT_SEED, help=f"first seed (default: {DEFAULT_SEED})"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        help=f"number of seeds from --seed on (default: {DEFAULT_REPEATS})",
    )
    parser.add_argument(
        "--batch", type=int, default=1, help="saturation: arrivals per batch k (default: 1)"
    )
    parser.add_argument("--openb-dir", help="folder holding the openb CSVs")
    parser.add_argument(
        "--out", help="write report.md, allocation.png and results.json into this folder"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise BadInput(f"--repeats must be >= 1, got {args.repeats}")
    if args.batch < 1:
        raise BadInput(f"--batch must be >= 1, got {args.batch}")
    workload = _load_workload(args.trace, args.openb_dir)
    cluster = _load_cluster(args.cluster, args.openb_dir)
    if args.protocol is None:
        builtin = args.trace is None and args.cluster is None
        args.protocol = "both" if builtin else "saturation"
    bar: ProgressBar = _Silent(1) if args.quiet else ProgressBar(1)
    return PROTOCOLS[args.protocol](args, cluster, workload, bar)
