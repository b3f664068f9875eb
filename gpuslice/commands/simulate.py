"""``gpuslice simulate``: the what-if simulator.

With no arguments it runs the built-in synthetic workload (``simulations/data/
default_workload.yaml``) on the built-in cluster (``simulations/data/default_cluster.yaml``, 96
nodes) through the saturation protocol for BestFit, FGD and gpuslice over seeds 42-51, then the
time-replay protocol on the built-in MIG scenario (CP-SAT vs nos-like greedy vs a static
layout), and prints both comparison tables.  Nothing outside the package is read.

``--trace`` takes an openb trace name (``default``, ``gpushare40`` ...; the folder comes from
``--openb-dir``, ``$GPUSLICE_OPENB_DIR`` or ``../shared/traces/openb``), an openb pod CSV, or a
workload YAML/JSON file (:mod:`simulations.inputs.workload`), and needs ``--cluster``: ``openb``, a
cluster YAML/JSON file (:mod:`simulations.inputs.cluster`), or ``builtin`` for the built-in cluster on
purpose.  Without ``--cluster`` the command refuses (exit 2): a trace replayed on a cluster it
was not written for silently answers another question.  ``--cluster`` alone runs the built-in
synthetic workload on that cluster (the first line of the output names both).

Output (``-o``, :mod:`gpuslice.output`): the comparison tables, or one document with ``-o
json|yaml``.  Progress goes to stderr (:mod:`gpuslice.progress`: a bar on a terminal, else an
occasional plain line; none with ``--quiet``).  Files are written only under ``--out DIR``:
:data:`WRITES` lists them per protocol, and ``--help`` prints that list.  The folder (and the
protocols' sub-folders) is made before the first run, or refused with exit 2
(:func:`gpuslice.options.out_folder`): a typo in ``--out`` must not lose the results at the end.
Should a report still fail to be written, the saturation results are printed all the same,
then the error (exit 2).

Protocols are looked up in :data:`PROTOCOLS` (name -> runner); another protocol plugs in by
adding an entry whose runner takes ``(args, cluster, workload, progress)`` and returns its
document (a dict with a ``protocol`` key), a renderer in :data:`RENDERERS` and its files in
:data:`WRITES`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import simulations
from gpuslice.cli import BadInput
from gpuslice.options import BUILTIN_CLUSTER, check_number, out_folder, trace_needs_cluster
from gpuslice.output import Column, add_output_argument, emit, render_table
from gpuslice.progress import Progress
from simulations.bench_saturation import aggregate, write_report
from simulations.inputs.cluster import Cluster, ClusterError, load_cluster
from simulations.inputs.openb import load_openb_pods, resolve_trace
from simulations.inputs.workload import Workload, WorkloadError, load_workload
from simulations.reports.replay_report import COLUMNS as REPLAY_COLUMNS
from simulations.reports.replay_report import REPLAY_FILES, ReportWriteError
from simulations.saturation.protocol import SaturationResult
from simulations.saturation.runner import ROWS, run_policy

HELP = "what-if simulator (default: built-in synthetic workload on a built-in cluster)"

DEFAULT_SEED = 42
DEFAULT_REPEATS = 10
MAX_REPEATS = 1000
"""Most seeds one run replays (``--repeats``): more would only run for days."""
MAX_BATCH = 10_000
"""Largest saturation batch (``--batch``): one plan per this many arrivals."""

WRITES: dict[str, tuple[str, ...]] = {
    "saturation": ("report.md", "results.json", "allocation.png"),
    "time-replay": REPLAY_FILES,
    "both": ("saturation/", "time-replay/"),
}
"""Protocol -> what ``--out DIR`` gets (a name ending in ``/``: a sub-folder holding that
protocol's files)."""

Doc = dict[str, Any]
ProtocolRunner = Callable[[argparse.Namespace, Cluster, Workload, Progress], Doc]


def _note(text: str) -> None:
    print(text, file=sys.stderr)


def _run_saturation_protocol(
    args: argparse.Namespace, cluster: Cluster, workload: Workload, bar: Progress
) -> Doc:
    policies = _policies(args.policy)
    seeds = list(range(args.seed, args.seed + args.repeats))
    runs = [(p, s) for p in policies for s in seeds]
    bar.set_total(len(runs) * 1000)
    results: list[SaturationResult] = []
    for i, (policy, seed) in enumerate(runs):

        def progress(
            done: int, total: int, i: int = i, policy: str = policy, seed: int = seed
        ) -> None:
            bar.update(i * 1000 + (1000 * done) // max(1, total), f"{policy} seed {seed}")

        try:
            results.append(
                run_policy(
                    cluster,
                    workload,
                    policy,
                    seed,
                    batch=args.batch,
                    progress=progress,
                    cpu_scheduler=args.cpu_scheduler,
                )
            )
        except ValueError as e:
            raise BadInput(str(e)) from None
    bar.close()
    doc: Doc = {
        "protocol": "saturation",
        "workload": f"{workload.name} ({len(workload)} pods)",
        "cluster": f"{cluster.name}: {cluster.summary()}",
        "seeds": seeds,
        "batch": args.batch,
        "cpu_scheduler": args.cpu_scheduler,
        "policies": policies,
        "summary": aggregate(results),
        "files": [],
    }
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
        try:
            doc["files"] = [str(p) for p in write_report(Path(args.out), results, setup)]
        except ReportWriteError as e:  # the results are printed all the same, then the error
            doc["write_error"] = f"--out {args.out}: {e}"
    return doc


def _run_time_replay_protocol(
    args: argparse.Namespace, cluster: Cluster, workload: Workload, bar: Progress
) -> Doc:
    """Time replay (simulations.reports.replay_protocol); no --trace/--cluster: its built-in MIG scenario."""
    from simulations.replay.engine import AgentOutage, ReplayError, ReplaySettings
    from simulations.replay.metrics import summarize
    from simulations.reports.replay_protocol import builtin_scenario, run_replay_protocol
    from simulations.reports.replay_report import replay_warnings

    if args.trace is None and args.cluster is None:
        workload, cluster = builtin_scenario()
    bar.set_total(1000)

    def progress(done: int, total: int, label: str) -> None:
        bar.update(1000 * done // max(1, total), label)

    try:
        outages = tuple(AgentOutage.parse(text) for text in args.agent_outage or ())
        settings = ReplaySettings(seed=args.seed, outages=outages)
    except ReplayError as e:
        raise BadInput(f"--agent-outage: {e}") from None
    policies = args.policy or replay_default_policies(cluster)
    try:
        _, results = run_replay_protocol(workload, cluster, policies, settings, args.out, progress)
    except (ReplayError, ValueError) as e:
        raise BadInput(str(e)) from None
    bar.close()
    return {
        "protocol": "time-replay",
        "workload": f"{workload.name} ({len(workload)} pods)",
        "cluster": f"{cluster.name}: {cluster.summary()}",
        "window": f"{settings.batch_timeout_s:g} s / {settings.batch_idle_s:g} s "
        "(greedy: nos's 60 s / 10 s)",
        "apply_delay_s": settings.apply_delay_s,
        "summaries": [summarize(r).as_dict() for r in results],
        "warnings": replay_warnings(results),
        "files": [str(Path(args.out) / name) for name in REPLAY_FILES] if args.out else [],
    }


def replay_default_policies(cluster: Cluster) -> str:
    """The time replay's policies without ``--policy``: CP-SAT, greedy and a static layout;
    the static layouts are MIG layouts, so a cluster with MPS nodes gets only the first two
    (said on stderr)."""
    from planner.snapshot import Mode
    from simulations.reports.replay_protocol import DEFAULT_POLICIES

    names = DEFAULT_POLICIES.split(",")
    if any(n.mode is Mode.MPS for n in cluster.nodes):
        kept = [n for n in names if not n.startswith("static:")]
        print(
            f"simulate: cluster {cluster.name} has MPS nodes: comparing {', '.join(kept)} "
            "(static layouts are MIG layouts)",
            file=sys.stderr,
        )
        names = kept
    return ",".join(names)


def _run_both_protocols(
    args: argparse.Namespace, cluster: Cluster, workload: Workload, bar: Progress
) -> Doc:
    """Saturation (GPU-share placement policies), then time replay (MIG partitioning policies).

    With ``--out DIR`` each protocol writes into its own sub-folder of ``DIR``.
    """
    out = args.out
    parts: Doc = {"protocol": "both"}
    for name, runner in (
        ("saturation", _run_saturation_protocol),
        ("time-replay", _run_time_replay_protocol),
    ):
        sub = argparse.Namespace(**{**vars(args), "out": str(Path(out) / name) if out else None})
        if name == "time-replay":
            sub.policy = None  # the replay compares partitioning policies, not placement ones
            bar = Progress("simulate: time replay", enabled=bar.enabled)
        parts[name] = runner(sub, cluster, workload, bar)
    return parts


PROTOCOLS: dict[str, ProtocolRunner] = {
    "saturation": _run_saturation_protocol,
    "time-replay": _run_time_replay_protocol,
    "both": _run_both_protocols,
}
"""Protocol name -> runner. Add entries here to offer more protocols."""


def _alloc130(r: Mapping[str, Any]) -> str:
    if r.get("alloc@130") is None:
        return "n/a"
    return f"{r['alloc@130']:.2f}±{r.get('alloc@130_sd', 0.0):.2f}"


def _num(key: str, fmt: str = "{:.2f}") -> Callable[[Mapping[str, Any]], str]:
    return lambda r: "n/a" if r.get(key) is None else fmt.format(r[key])


SATURATION_COLUMNS = (
    Column("policy", "label"),
    Column("protocol", "protocol"),
    Column("alloc@130 %", _alloc130, align="right"),
    Column("alloc@100 %", _num("alloc@100"), align="right"),
    Column("final %", _num("final_alloc"), align="right"),
    Column("frag amt@100", _num("frag_amount@100"), align="right"),
    Column("frag ratio@100", _num("frag_ratio@100"), align="right"),
    Column("idle GPUs", _num("unallocated_gpus", "{:.1f}"), align="right"),
    Column("failed", _num("failed_pods", "{:.0f}"), align="right"),
    Column("pods", _num("pods", "{:.0f}"), align="right", wide=True),
    Column("s/run", _num("runtime_s"), align="right"),
)
_REPLAY_WIDE = {"planner_ms_p50", "planner_ms_p95"}
TIME_REPLAY_COLUMNS = tuple(
    Column(
        header,
        _num(field, fmt) if field != "policy" else "policy",
        wide=field in _REPLAY_WIDE,
        align="left" if field == "policy" else "right",
    )
    for field, header, fmt in REPLAY_COLUMNS
)


def _render_saturation(doc: Doc, wide: bool, width: int | None) -> list[str]:
    seeds = doc["seeds"]
    rows = [{"label": label, **r} for label, r in doc["summary"].items()]
    return [
        f"saturation protocol: {doc['workload']} on {doc['cluster']}; seeds "
        f"{seeds[0]}-{seeds[-1]}, batch k={doc['batch']}",
        render_table(SATURATION_COLUMNS, rows, wide=wide, width=width),
    ]


def _render_time_replay(doc: Doc, wide: bool, width: int | None) -> list[str]:
    return [
        f"time replay: {doc['workload']} on {doc['cluster']}; window {doc['window']}, apply "
        f"delay {doc['apply_delay_s']:g} s",
        render_table(TIME_REPLAY_COLUMNS, doc["summaries"], wide=wide, width=width),
        *(f"warning: {w}" for w in doc.get("warnings", ())),
    ]


RENDERERS: dict[str, Callable[[Doc, bool, int | None], list[str]]] = {
    "saturation": _render_saturation,
    "time-replay": _render_time_replay,
}
"""Protocol -> its table form (lines)."""


def render_text(doc: Doc, wide: bool = False, width: int | None = None) -> str:
    parts = [doc[p] for p in ("saturation", "time-replay")] if doc["protocol"] == "both" else [doc]
    return "\n\n".join("\n".join(RENDERERS[p["protocol"]](p, wide, width)) for p in parts)


def _policies(spec: str | None) -> list[str]:
    if not spec:
        return list(ROWS)
    names = [p.strip().lower() for p in spec.split(",") if p.strip()]
    unknown = [p for p in names if p not in ROWS]
    if unknown or not names:
        raise BadInput(
            f"--policy {spec!r}: unknown {unknown}; choose from {', '.join(ROWS)} (comma-separated)"
        )
    return names


def _builtin(name: str) -> Path:
    """A file of the package data ``simulations/data``."""
    return Path(simulations.__file__).parent / "data" / name


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
        if spec is None or spec == BUILTIN_CLUSTER:
            return load_cluster(str(_builtin("default_cluster.yaml")))
        return load_cluster(spec, openb_directory)
    except (ClusterError, WorkloadError) as e:
        raise BadInput(str(e)) from None


def _writes_help() -> str:
    per = "; ".join(
        f"{protocol}: {', '.join(names)}"
        for protocol, names in WRITES.items()
        if protocol != "both"
    )
    return (
        f"write the reports into this folder (created if missing) -- {per}; both: one "
        f"sub-folder per protocol, {' and '.join(WRITES['both'])}. Default: write nothing"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace",
        help="openb trace name (default, gpushare40, ...), openb pod CSV, or workload "
        "YAML/JSON (needs --cluster; default: built-in synthetic)",
    )
    parser.add_argument(
        "--cluster",
        help=f"'openb', a cluster YAML/JSON file, or '{BUILTIN_CLUSTER}' (the built-in 96-node "
        "cluster; the default without --trace)",
    )
    parser.add_argument(
        "--policy",
        help=f"comma-separated policies: for the saturation protocol {', '.join(ROWS)} "
        "(default: all), for the time replay cpsat, greedy, static:<layout> (default: "
        "cpsat,greedy,static:balanced; without the static layout on a cluster with MPS nodes)",
    )
    parser.add_argument(
        "--protocol",
        default=None,
        choices=sorted(PROTOCOLS),
        help="simulation protocol (default: both on the built-in workload and cluster, "
        "saturation when --trace or --cluster is given, time-replay for a workload whose pods "
        "request MIG profiles or MPS sizes by name)",
    )
    parser.add_argument(
        "--seed", type=int, default=DEFAULT_SEED, help=f"first seed (default: {DEFAULT_SEED})"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        help=f"number of seeds from --seed on (1 to {MAX_REPEATS}, default: {DEFAULT_REPEATS})",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=1,
        help=f"saturation: arrivals per batch k (1 to {MAX_BATCH}, default: 1)",
    )
    parser.add_argument(
        "--cpu-scheduler",
        default="bestfit",
        help="saturation: who places the partitioner protocol's CPU-only pods: bestfit "
        "(FGD's, the default), least-allocated (kube-scheduler's default profile) or "
        "most-allocated (its bin-packing profile)",
    )
    parser.add_argument(
        "--agent-outage",
        action="append",
        metavar="NODE:START:END",
        help="time replay: stop that node's agent from START to END seconds of simulated time "
        "(repeatable): it applies nothing, reports nothing, and the kubelet refuses pods there "
        "(the operations guide, 'An agent that stops')",
    )
    parser.add_argument("--openb-dir", help="folder holding the openb CSVs")
    parser.add_argument("--out", metavar="DIR", help=_writes_help())
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    add_output_argument(parser, what="the comparison")


def run(args: argparse.Namespace) -> int:
    check_number("--repeats", args.repeats, 1, MAX_REPEATS)
    check_number("--batch", args.batch, 1, MAX_BATCH)
    trace_needs_cluster("simulate", args.trace, args.cluster)
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise BadInput(f"--out {args.out}: not a folder; give a folder for the reports")
    workload = _load_workload(args.trace, args.openb_dir)
    cluster = _load_cluster(args.cluster, args.openb_dir)
    if args.protocol is None:
        builtin = args.trace is None and args.cluster is None
        # a workload naming MIG profiles/MPS sizes (gpuslice export) can only be time-replayed
        replay = bool(workload.slice_pods)
        args.protocol = "both" if builtin else "time-replay" if replay else "saturation"
    if args.agent_outage and args.protocol != "time-replay":
        raise BadInput(
            "--agent-outage needs the time replay (--protocol time-replay): the saturation "
            "protocol has no agents"
        )
    if args.protocol != "time-replay":
        from simulations.inputs.workload_slices import require_shares

        try:
            require_shares(workload, args.protocol)
        except WorkloadError as e:
            raise BadInput(str(e)) from None
    out_folder(args.out, out_files(args.protocol))  # before the runs: results must not be lost
    label = "simulate: " + ("saturation" if args.protocol == "both" else args.protocol)
    with Progress(label, enabled=not args.quiet) as bar:
        doc = PROTOCOLS[args.protocol](args, cluster, workload, bar)
    emit(doc, args.output, lambda wide, width: render_text(doc, wide, width))
    parts = [doc[p] for p in ("saturation", "time-replay")] if "files" not in doc else [doc]
    for part in parts:
        for path in part["files"]:
            _note(f"wrote {path}")
    errors = [part["write_error"] for part in parts if part.get("write_error")]
    if errors:
        raise BadInput(f"{'; '.join(errors)} (the results are printed above)")
    return 0


def out_files(protocol: str) -> list[str]:
    """What ``--out DIR`` gets for ``protocol``, relative to ``DIR`` (:data:`WRITES`, with the
    sub-folders' files)."""
    if protocol != "both":
        return list(WRITES[protocol])
    return [f"{sub}{name}" for sub in WRITES["both"] for name in WRITES[sub.rstrip("/")]]
