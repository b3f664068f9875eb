"""Time-replay benchmark, MIG mode: ``python -m simulations.bench_replay`` prints JSON.

Scenario
--------
The openb ``default`` trace (``--trace``) replayed over time (:mod:`simulations.replay.engine`) on
``--nodes`` nodes of eight A100-SXM4-80GB GPUs in MIG mode (DGX A100-like hosts: 256 CPU
threads, 2 TiB memory, so GPUs are the bottleneck).  Fractional requests map to MIG profiles by
compute (``ceil(gpu_milli x 7 / 1000)`` compute slices; most openb pods then need a 7g or 4g).
The default of 8 nodes (64 GPUs, the issue's figure) is below the trace's MIG geometry bound
(70 GPUs, see below), so the trace saturates the cluster at its peaks only (demand, in compute
slices, exceeds 64 GPUs for well under 1 % of the busy period); ``--nodes 5`` (40 GPUs)
saturates it about a third of the busy period (the trace averages about 38 GPUs of demand
after its first 10^7 s).

Policies
--------
* ``cpsat`` — gpuslice: the partitioner's decision step with the CP-SAT planner;
* ``greedy`` — the nos-like greedy planner with nos's 60 s / 10 s batch window;
* ``dra`` — DRA mode as the agent runs it (``gpuslice agent --dra``): every placement
  published, claims allocated first-fit by kube-scheduler, instances made at prepare and
  destroyed at unprepare (:mod:`simulations.replay.dra`); ``--render-modes`` tables it beside
  ``cpsat`` and ``greedy``;
* ``dra-shaped`` — DRA mode with planner-shaped publishing: claim pods gated, planned and
  released by the partitioner, the agents publishing the planned placements and keeping
  instances the plan lists (:mod:`simulations.replay.engine`, "DRA mode");
  ``--render-shaped`` tables it beside ``dra`` with issue 15's verdict;
* ``best-static`` — the best of the static candidates
  (:func:`simulations.replay.static_layouts.static_candidates`: the built-in layouts and CP-SAT mixes
  matched to the trace's average and peak demand), ranked by (pods never scheduled, p95, p50).
Both planner policies use the same batch window (``--timeout``/``--idle``, default nos's
60 s / 10 s) and retry time, so the comparison isolates the planner.

Bound
-----
``geometry_bound``: :func:`simulations.saturation.geometry_bound.geometry_bound` — the maximum over time
of the fewest GPUs whose valid MIG layouts hold every instance the trace's pods hold at that
time (pods at their trace times), solved exactly as a pattern integer program with CP-SAT;
node boundaries and CPU ignored, so it is a lower bound for any policy.

Hybrid and mixed clusters
-------------------------
``--mode hybrid`` makes every node hybrid (MPS slices inside MIG instances); pods then map with
``hybrid-threshold:500`` (shares of at least 500 milli and whole GPUs get a MIG instance, smaller
shares an MPS slice inside one; ``--mapping`` overrides).  ``--models A,B`` gives node ``i`` the
model ``i mod len``: ``--models A100-SXM4-80GB,H100-SXM5-80GB`` alternates A100 and H100 nodes.
Pods are mapped for the model with the most GPUs (:func:`simulations.replay.engine.cluster_replay_pods`;
on A100-80GB and H100-80GB every profile name and slice size exists on both, so a pod may run on
either).  ``best-static`` needs a one-model MIG cluster.  The JSON and table are the MIG run's;
a cell of a non-default cluster carries its ``cluster`` label, shown in the table's trace column.

Whole-node pods in a pool of their own
--------------------------------------
``--max-pod-slices 7`` leaves out every pod that asks for more than seven slices (on the openb
traces in MIG mode: the eight-GPU pods, 0.5-2 % of the GPU pods), as a platform team does that
runs whole-node training jobs on a node pool of their own.  It separates the two things the
replay's figures mix: how fast the small pods are served, and what serving the whole-node pods
costs them (nos-like greedy serves those only once no smaller pod waits, since kube-scheduler
spreads pods so nodes seldom empty; gpuslice packs and serves them in turn).  The settings in
the JSON name the option; the table's whole-node column is then empty.

Trace log
---------
``--trace-log FILE`` also writes, per cell and policy, what the summary counts but does not
show: every GPU layout an applied spec changed (time, node, GPU, devices before and after,
the pods waiting then per request), those changes counted by transition (``7g.80gb ->
4g.40gb``: 260 on openb default at 5 nodes), and every pod's arrival, first binding and
pending time.  It answers "what are the reconfigurations for" and "who waits, when" without
patching the replay (:attr:`~simulations.replay.engine.ReplaySettings.record_changes`;
spec-driven changes only: DRA prepares and static layouts are not specs).  Recording changes
no decision.

Output: one JSON document (``--out FILE`` also writes it there; ``--report DIR`` writes the
Markdown report with plots).  Runs take minutes on the full trace; ``--compression`` and
``--limit`` make smaller runs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from planner.catalog import GpuModel, default_catalog
from planner.settings import PlannerSettings, Policy
from planner.snapshot import Mode, mig_profile_of
from simulations.inputs.cluster import Cluster, Node
from simulations.inputs.openb import OPENB_TRACES, load_openb_pods, resolve_trace
from simulations.inputs.timeline import borrow_times, has_times
from simulations.inputs.workload import Workload
from simulations.replay.engine import (
    NOS_WINDOW,
    AgentOutage,
    ReplayError,
    ReplayPod,
    ReplayPolicy,
    ReplaySettings,
    build_fake_cluster,
    cluster_kinds,
    cluster_replay_pods,
    default_mapping,
    parse_policy,
    run_time_replay,
)
from simulations.replay.metrics import ReplayResult, change_log, request_shape, summarize
from simulations.replay.static_layouts import StaticPolicy, best_static, static_candidates
from simulations.reports.out_file import out_file_error
from simulations.saturation.geometry_bound import geometry_bound

__all__ = [
    "ResultsFileError",
    "average_demand",
    "main",
    "mig_cluster",
    "render_modes_table",
    "render_shaped_table",
    "render_table",
    "shaped_verdict",
    "verdict",
]

MODEL = "A100-SXM4-80GB"


def mig_cluster(
    nodes: int,
    gpus_per_node: int = 8,
    model: str = MODEL,
    mode: Mode = Mode.MIG,
    models: Sequence[str] = (),
) -> Cluster:
    """``nodes`` DGX-like nodes in ``mode``; with ``models``, node ``i`` gets ``models[i % n]``
    (catalog names or product labels), else every node ``model``."""
    names = [default_catalog().model(m).name for m in (models or (model,))]
    label = "+".join(dict.fromkeys(names))
    return Cluster(
        f"{nodes}x{gpus_per_node}-{label}" + ("" if mode is Mode.MIG else f"-{mode.value}"),
        tuple(
            Node(
                f"dgx-{i:03d}",
                cpu_milli=256_000,
                memory_mib=2 * 1024 * 1024,
                gpus=gpus_per_node,
                model=names[i % len(names)],
                mode=mode,
                catalog_model=names[i % len(names)],
            )
            for i in range(nodes)
        ),
        source="bench_replay",
    )


def cluster_label(opts: dict[str, Any]) -> str:
    """``""`` for the default cluster (A100 MIG), else e.g. ``hybrid A100-SXM4-80GB+H100-80GB``."""
    models = opts.get("models") or [MODEL]
    mode = opts.get("mode", "mig")
    if mode == "mig" and [default_catalog().model(m).name for m in models] == [MODEL]:
        return ""
    names = "+".join(dict.fromkeys(default_catalog().model(m).name for m in models))
    return f"{mode} {names}"


def _cluster_of(nodes: int, opts: dict[str, Any]) -> Cluster:
    return mig_cluster(nodes, mode=Mode(opts.get("mode", "mig")), models=opts.get("models") or ())


def _pods_for(workload: Workload, cluster: Cluster, settings: ReplaySettings) -> list[ReplayPod]:
    fake = build_fake_cluster(cluster, mps_reserve_mib=settings.planner.mps_reserve_mib)
    return cluster_replay_pods(workload, fake, settings)


def average_demand(model: GpuModel, pods: Sequence[ReplayPod]) -> dict[str, float]:
    """Time-averaged concurrent instances per profile shape over the pods' arrival span."""
    if not pods:
        return {}
    start = min(p.arrival for p in pods)
    end = max(p.arrival + p.duration for p in pods)
    span = max(end - start, 1e-9)
    total: Counter[str] = Counter()
    for p in pods:
        for resource, k in p.requests.items():
            profile = mig_profile_of(resource)
            if profile is not None:
                total[model.profile(profile).shape] += k * p.duration  # type: ignore[assignment]
    return {shape: v / span for shape, v in total.items()}


def _static_key(result: ReplayResult) -> tuple[float, ...]:
    s = summarize(result)
    return (float(s.never_scheduled), s.pending_p95_s, s.pending_p50_s)


def _load(trace: str, openb_dir: str | None, times_from: str, seed: int) -> tuple[Workload, str]:
    """The trace, with times borrowed from ``times_from`` if it has none (simulations.inputs.timeline)."""
    workload = load_openb_pods(resolve_trace(trace, openb_dir))
    if has_times(workload):
        return workload, ""
    reference = load_openb_pods(resolve_trace(times_from, openb_dir))
    return borrow_times(workload, reference, seed), times_from


def verdict(cpsat: dict[str, Any], greedy: dict[str, Any]) -> dict[str, Any]:
    """Issue 9's acceptance rule for one cell (CP-SAT with reservations vs nos-like greedy).

    Where greedy's p95 is between 60 s and an hour, CP-SAT's p95 must be at most half of it; in
    deeper overload (greedy p95 over an hour) CP-SAT's p95 and p99 at most 0.9 of greedy's;
    everywhere CP-SAT's p99 at most greedy's, no pod disrupted, no more GPUs reconfigured and
    no theft.
    """
    g95, g99 = greedy["pending_p95_s"], greedy["pending_p99_s"]
    c95, c99 = cpsat["pending_p95_s"], cpsat["pending_p99_s"]
    checks: dict[str, bool] = {
        "p99 <= greedy": c99 <= g99,
        "0 disrupted": cpsat["pods_disrupted"] == 0,
        "reconfigured <= greedy": cpsat["gpus_reconfigured"] <= greedy["gpus_reconfigured"],
        "0 theft": cpsat["theft"] == 0,
    }
    regime = "light (greedy p95 < 60 s)"
    if 60 <= g95 <= 3600:
        regime = "overload (greedy p95 60 s - 1 h)"
        checks["p95 <= 0.5 x greedy"] = c95 <= 0.5 * g95
    elif g95 > 3600:
        regime = "deep overload (greedy p95 > 1 h)"
        checks["p95 <= 0.9 x greedy"] = c95 <= 0.9 * g95
        checks["p99 <= 0.9 x greedy"] = c99 <= 0.9 * g99
    return {
        "regime": regime,
        "p95_ratio": round(c95 / g95, 3) if g95 else None,
        "p99_ratio": round(c99 / g99, 3) if g99 else None,
        "checks": checks,
        "pass": all(checks.values()),
    }


_TRACE_LOG = "_trace_log"
"""Key of a cell's trace log in :func:`_cell`'s summary; :func:`main` moves it to ``--trace-log``."""


def trace_log(result: ReplayResult) -> dict[str, Any]:
    """One replay's ``--trace-log`` entry: how often each layout became each other one
    (``transitions``, most frequent first), every layout change with the waiting queue then,
    and every pod's arrival, first binding and total pending time."""
    return {
        **change_log(result),
        "pods": [
            {
                "name": p.name,
                "request": request_shape(p.requests),
                "arrival": p.arrival,
                "first_bound": p.first_bound,
                "pending_s": p.pending_at(result.end),
            }
            for p in result.pods
        ],
    }


def _settings(opts: dict[str, Any]) -> ReplaySettings:
    """The replay settings of a run (``opts["settings"]``: JSON-ready; outages as triples)."""
    given = dict(opts["settings"])
    outages = tuple(AgentOutage(n, s, e) for n, s, e in given.pop("outages", ()))
    return ReplaySettings(
        **given, outages=outages, planner=PlannerSettings(time_limit_s=opts["limit"])
    )


def _cell(job: tuple[str, int, str, dict[str, Any]]) -> tuple[str, int, str, dict[str, Any]]:
    """One (trace, nodes, policy) replay, in its own process when ``--jobs`` > 1."""
    trace, nodes, name, opts = job
    model = default_catalog().model(MODEL)
    workload, times_from = _load(trace, opts["openb_dir"], opts["times_from"], opts["seed"])
    settings = _settings(opts)
    cluster = _cluster_of(nodes, opts)
    pods = _pods_for(workload, cluster, settings)
    if opts["limit_pods"]:
        pods = pods[: opts["limit_pods"]]
    if opts["max_pod_slices"]:
        pods = [p for p in pods if sum(p.requests.values()) <= opts["max_pod_slices"]]
    if name == "static":
        if cluster_label(opts):
            raise ReplayError("best-static needs the default one-model MIG cluster")
        gpus = cluster.total_gpus
        bound = geometry_bound(model, pods)
        peak = {model.profile(p).shape: float(n) for p, n in bound.demand.items()}
        candidates = static_candidates(model, gpus, average_demand(model, pods), peak)
        best, chosen, _runs = _best_static(candidates, workload, cluster, settings, pods)
        return trace, nodes, "best-static", {"layout": best.name, **summarize(chosen).as_dict()}
    pol = parse_policy(name)
    if pol.planner_policy is Policy.CPSAT:
        pol = replace(pol, window=None)  # the settings' window: the same as greedy's by default
    result = run_time_replay(workload, cluster, pol, settings, pods=pods)
    out = summarize(result).as_dict()
    out["gpu_pods"] = len(pods)
    out["times_from"] = times_from
    out["wall_s"] = round(result.wall_s, 1)
    if settings.record_changes:
        out[_TRACE_LOG] = trace_log(result)
    print(
        f"bench_replay: {trace} {nodes} nodes {name}: p95 {out['pending_p95_s']:.0f} s, "
        f"p99 {out['pending_p99_s']:.0f} s, {result.wall_s:.0f} s wall",
        file=sys.stderr,
        flush=True,
    )
    return trace, nodes, name, out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m simulations.bench_replay", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--trace", default="default", help="trace name(s), comma-separated, or all")
    ap.add_argument("--openb-dir")
    ap.add_argument("--nodes", default="8", help="node count(s), comma-separated")
    ap.add_argument("--compression", type=float, default=1.0)
    ap.add_argument(
        "--limit", type=int, default=0, help="replay only the first N GPU pods (0 = all)"
    )
    ap.add_argument(
        "--max-pod-slices",
        type=int,
        default=0,
        help="leave out pods asking for more slices than this (after --limit; 7 on the openb "
        "traces: the eight-GPU pods, as if they ran on a pool of their own; 0: keep all)",
    )
    ap.add_argument("--timeout", type=float, default=NOS_WINDOW[0])
    ap.add_argument("--idle", type=float, default=NOS_WINDOW[1])
    ap.add_argument("--retry", type=float, default=60.0)
    ap.add_argument("--apply-delay", type=float, default=5.0)
    ap.add_argument(
        "--drain-fraction",
        type=float,
        default=0.1,
        help="partitioner setting drainFraction: most GPUs draining at once (0: no drains)",
    )
    ap.add_argument(
        "--drain-overtaken",
        type=int,
        default=0,
        help="partitioner setting drainOvertaken: drain only pods this many younger slice pods "
        "have overtaken (0: any pod past the drain wait; greedy never drains)",
    )
    ap.add_argument(
        "--drain-queue-limit",
        type=float,
        default=0.1,
        help="partitioner setting drainQueueLimit: drains start only while at most this many "
        "slice units wait per GPU (inf: always)",
    )
    ap.add_argument(
        "--warm-share",
        type=float,
        default=0.0,
        help="partitioner setting warmSliceShare: keep one free slice of each request that at "
        "least this share of the bound one-slice pods hold (0: off; greedy has none)",
    )
    ap.add_argument("--time-limit", type=float, default=1.0, help="CP-SAT seconds per plan")
    ap.add_argument("--policies", default="cpsat,greedy")
    ap.add_argument(
        "--mode",
        default="mig",
        choices=("mig", "hybrid"),
        help="partitioning mode of every node (hybrid: MPS slices inside MIG instances)",
    )
    ap.add_argument(
        "--models",
        default="",
        help=f"GPU models, comma-separated: node i gets model i mod n (default {MODEL})",
    )
    ap.add_argument(
        "--mapping",
        default="",
        help="simulations.inputs.mapping rule (default: mig-compute on MIG, hybrid-threshold:500 on "
        "hybrid clusters)",
    )
    ap.add_argument(
        "--times-from",
        default="default",
        help="trace lending creation/deletion times to a trace without them (multigpu20)",
    )
    ap.add_argument("--seed", type=int, default=0, help="seeds tie-breaks and borrowed times")
    ap.add_argument(
        "--agent-outage",
        action="append",
        metavar="NODE:START:END",
        help="stop that node's agent from START to END simulated seconds (repeatable; node "
        "names as the cluster has them: dgx-000, dgx-001, ...): what an agent crash costs",
    )
    ap.add_argument("--jobs", type=int, default=1, help="replays run in parallel processes")
    ap.add_argument("--out")
    ap.add_argument("--report", help="write the Markdown report (one trace and node count only)")
    ap.add_argument(
        "--trace-log",
        metavar="FILE",
        help="also write, per cell and policy, every GPU layout an applied spec changed (with "
        "the waiting queue then), the layout transitions counted, and every pod's wait (JSON)",
    )
    ap.add_argument(
        "--render",
        nargs="+",
        metavar="JSON",
        help="print the Markdown table of earlier runs' JSON outputs (merged) and exit",
    )
    ap.add_argument(
        "--render-modes",
        nargs="+",
        metavar="JSON",
        help="print the Markdown table of DRA mode (policy dra) beside cpsat and greedy from "
        "earlier runs' JSON outputs (merged) and exit",
    )
    ap.add_argument(
        "--render-shaped",
        nargs="+",
        metavar="JSON",
        help="print the Markdown table of planner-shaped DRA publishing (policy dra-shaped) "
        "beside publish-everything (dra) from earlier runs' JSON outputs (merged) and exit",
    )
    args = ap.parse_args(argv)
    renders = (
        (args.render, render_table),
        (args.render_modes, render_modes_table),
        (args.render_shaped, render_shaped_table),
    )
    for paths, render in renders:
        if paths:
            try:
                print(render(paths))
            except ResultsFileError as e:
                ap.error(str(e))  # exit status 2
            except (KeyError, TypeError, ValueError) as e:  # a cell without a figure a table needs
                ap.error(
                    f"{', '.join(paths)}: a run lacks {e!r}; give files that bench_replay's "
                    "--out wrote"
                )
            return 0
    for option, path in (
        ("--out", args.out),
        ("--report", args.report),
        ("--trace-log", args.trace_log),
    ):
        if problem := out_file_error(option, path):
            ap.error(problem)  # before the replays, which may take an hour

    if args.max_pod_slices < 0:
        ap.error(f"--max-pod-slices must be 0 (keep all) or more, not {args.max_pod_slices}")
    if not 0 <= args.warm_share <= 1:
        ap.error(f"--warm-share must be in [0, 1] (0: off), not {args.warm_share}")
    traces = list(OPENB_TRACES) if args.trace == "all" else _split(args.trace)
    node_counts = [int(n) for n in _split(args.nodes)]
    wanted = _split(args.policies)
    opts = {
        "openb_dir": args.openb_dir,
        "times_from": args.times_from,
        "seed": args.seed,
        "limit": args.time_limit,
        "limit_pods": args.limit,
        "max_pod_slices": args.max_pod_slices,
        "mode": args.mode,
        "models": _split(args.models) if args.models else [],
        "settings": {
            "batch_timeout_s": args.timeout,
            "batch_idle_s": args.idle,
            "batch_retry_s": args.retry,
            "apply_delay_s": args.apply_delay,
            "drain_overtaken": args.drain_overtaken,
            "drain_queue_limit": args.drain_queue_limit,
            "warm_share": args.warm_share,
            "drain_fraction": args.drain_fraction,
            "time_compression": args.compression,
            "seed": args.seed,
        },
    }
    if args.mapping:
        opts["settings"]["mapping"] = args.mapping  # type: ignore[index]
    if args.trace_log:
        opts["settings"]["record_changes"] = True  # type: ignore[index]
    if args.agent_outage:
        try:
            outages = [AgentOutage.parse(text) for text in args.agent_outage]
        except ReplayError as e:
            ap.error(str(e))  # exit status 2
        opts["settings"]["outages"] = [[o.node, o.start_s, o.end_s] for o in outages]  # type: ignore[index]
    label = cluster_label(opts)
    jobs = [(t, n, p, opts) for t in traces for n in node_counts for p in wanted]
    t0 = time.perf_counter()
    if args.jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            done = pool.map(_cell, jobs, chunksize=1)
    else:
        done = [_cell(j) for j in jobs]
    cells: dict[tuple[str, int], dict[str, Any]] = {}
    logs: list[dict[str, Any]] = []
    for trace, nodes, name, summary in done:
        log = summary.pop(_TRACE_LOG, None)
        if log is not None:
            logs.append({"trace": trace, "nodes": nodes, "policy": name, **log})
            top = ", ".join(f"{k} {v}" for k, v in list(log["transitions"].items())[:3])
            print(
                f"bench_replay: {trace} {nodes} nodes {name}: "
                f"{len(log['layout_changes'])} GPU layout changes ({top or 'none'})",
                file=sys.stderr,
            )
        cell = cells.setdefault(
            (trace, nodes),
            {"trace": trace, "nodes": nodes, "gpus": nodes * 8, "policies": {}},
        )
        if label:
            cell["cluster"] = label
        cell["policies"][name] = summary
    for cell in cells.values():
        pols = cell["policies"]
        if "cpsat" in pols and "greedy" in pols:
            cell["verdict"] = verdict(pols["cpsat"], pols["greedy"])
    kinds = cluster_kinds(
        build_fake_cluster(_cluster_of(max(node_counts), opts))  # every model and mode
    )
    doc: dict[str, Any] = {
        "benchmark": f"time replay, {label}" if label else "time replay, MIG",
        "date": dt.date.today().isoformat(),
        "command": "python -m simulations.bench_replay "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "settings": {
            **opts["settings"],
            "cpsat_time_limit_s": args.time_limit,
            "mapping": args.mapping or default_mapping(kinds),
            "model": "+".join(dict.fromkeys(m.name for m, _ in kinds)) if label else MODEL,
            **({"mode": args.mode} if label else {}),
            "times_from": args.times_from,
            **({"max_pod_slices": args.max_pod_slices} if args.max_pod_slices else {}),
        },
        "cells": list(cells.values()),
        "all_pass": all(c.get("verdict", {}).get("pass", True) for c in cells.values()),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    text = json.dumps(doc, indent=2, default=str)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.trace_log:
        with open(args.trace_log, "w") as f:
            json.dump({"command": doc["command"], "date": doc["date"], "cells": logs}, f)
            f.write("\n")
    if args.report and len(cells) == 1:
        _write_report(args, traces[0], node_counts[0], opts)
    return 0


def _merged_cells(paths: Sequence[str]) -> dict[tuple[str, int, str], dict[str, Any]]:
    """The cells of several ``--out`` files, merged per policy (a later file's run of a policy
    replaces an earlier one's)."""
    cells: dict[tuple[str, int, str], dict[str, Any]] = {}
    for path in paths:
        try:
            with open(path) as f:
                doc = json.load(f)
        except OSError as e:
            raise ResultsFileError(f"{path}: cannot be read ({e.strerror})") from e
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ResultsFileError(f"{path}: is not JSON ({e}); give a file --out wrote") from e
        found = doc.get("cells") if isinstance(doc, dict) else None
        if not isinstance(found, list):
            raise ResultsFileError(
                f"{path}: has no 'cells' list; give a file that bench_replay's --out wrote"
            )
        for i, cell in enumerate(found):
            try:
                key = (str(cell["trace"]), int(cell["nodes"]), str(cell.get("cluster", "")))
                policies = dict(cell["policies"])
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise ResultsFileError(
                    f"{path}: cell {i} lacks trace, nodes or policies ({e!r}); give a file "
                    "that bench_replay's --out wrote"
                ) from e
            have = cells.setdefault(key, {**cell, "policies": {}})
            have["policies"].update(policies)
    return cells


class ResultsFileError(ValueError):
    """A ``--render*`` input is not a readable ``--out`` document of this benchmark."""


WHOLE_NODE = "nvidia.com/mig-7g.80gb x8"
"""The request of a pod that needs a whole node (eight full GPUs)."""


def _pend(p: dict[str, Any]) -> str:
    return f"{p['pending_p50_s']:,.0f} / {p['pending_p95_s']:,.0f} / {p['pending_p99_s']:,.0f}"


def _whole(p: dict[str, Any]) -> str:
    row = (p.get("pending_by_size") or {}).get(WHOLE_NODE)
    return "-" if not row else f"{row['p50']:,.0f}"


def _ordered_cells(paths: Sequence[str]) -> list[tuple[str, int, str, dict[str, Any]]]:
    """The merged cells as ``(trace, nodes, label, cell)``, by label, openb trace, nodes."""
    order = {t: i for i, t in enumerate(OPENB_TRACES)}
    cells = _merged_cells(paths)
    return [
        (trace, nodes, label, cell)
        for (trace, nodes, label), cell in sorted(
            cells.items(), key=lambda kv: (kv[0][2], order.get(kv[0][0], 99), kv[0][1])
        )
    ]


def _rows_with(paths: Sequence[str], *policies: str) -> list[tuple[str, list[dict[str, Any]]]]:
    """Per merged cell in table order (:func:`_ordered_cells`) that ran every one of
    ``policies``: the row's first two columns (trace, nodes and GPUs) and each policy's
    summary in the order asked.  No such cell is an error (an empty table says nothing)."""
    rows = []
    for trace, nodes, label, cell in _ordered_cells(paths):
        pols = cell["policies"]
        if all(p in pols for p in policies):
            head = f"| {trace}{f' ({label})' if label else ''} | {nodes} ({cell['gpus']}) "
            rows.append((head, [pols[p] for p in policies]))
    if not rows:
        raise ResultsFileError(
            f"{', '.join(paths)}: no cell ran all of {', '.join(policies)}; this table needs "
            f"runs of --policies {','.join(policies)}"
        )
    return rows


def render_modes_table(paths: Sequence[str]) -> str:
    """DRA mode (policy ``dra``) beside the device-plugin policies (``cpsat``, ``greedy``):
    pending p50 / p95 / p99, the whole-node pods' median wait, GPUs reconfigured."""
    rows = [
        "| trace | nodes (GPUs) | pending p50 / p95 / p99 (s): DRA first-fit | CP-SAT | greedy "
        "| whole-node pods, median wait (s): DRA / CP-SAT / greedy "
        "| GPUs reconfigured: DRA / CP-SAT / greedy |",
        "|---|---|---|---|---|---|---|",
    ]
    for head, (d, c, g) in _rows_with(paths, "dra", "cpsat", "greedy"):
        rows.append(
            f"{head}| {_pend(d)} | {_pend(c)} | {_pend(g)} "
            f"| {_whole(d)} / {_whole(c)} / {_whole(g)} "
            f"| {d['gpus_reconfigured']:,} / {c['gpus_reconfigured']:,} / {g['gpus_reconfigured']:,} |"
        )
    return "\n".join(rows)


def shaped_verdict(everything: dict[str, Any], shaped: dict[str, Any]) -> str:
    """Issue 15's bar for planner-shaped publishing against publish-everything: fewer GPUs
    reconfigured and a p95 wait no worse."""
    failed = []
    if not shaped["gpus_reconfigured"] < everything["gpus_reconfigured"]:
        failed.append("reconfigured < publish-everything")
    if not shaped["pending_p95_s"] <= everything["pending_p95_s"]:
        failed.append("p95 <= publish-everything")
    return "pass" if not failed else "FAIL: " + ", ".join(failed)


def render_shaped_table(paths: Sequence[str]) -> str:
    """DRA mode: planner-shaped publishing (``dra-shaped``) beside publish-everything (``dra``):
    pending p50 / p95 / p99, the p95 ratio, the whole-node pods' median wait, GPUs
    reconfigured and issue 15's verdict."""
    rows = [
        "| trace | nodes (GPUs) | pending p50 / p95 / p99 (s): planner-shaped "
        "| publish-everything | p95 ratio | whole-node pods, median wait (s): shaped / everything "
        "| GPUs reconfigured: shaped / everything | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for head, (s, e) in _rows_with(paths, "dra-shaped", "dra"):
        ratio = f"{s['pending_p95_s'] / e['pending_p95_s']:.2f}" if e["pending_p95_s"] > 0 else "-"
        rows.append(
            f"{head}| {_pend(s)} | {_pend(e)} | {ratio} | {_whole(s)} / {_whole(e)} "
            f"| {s['gpus_reconfigured']:,} / {e['gpus_reconfigured']:,} "
            f"| {shaped_verdict(e, s)} |"
        )
    return "\n".join(rows)


def render_table(paths: Sequence[str]) -> str:
    """One Markdown table of the cells of several ``--out`` files, merged per policy (a later
    file's run of a policy replaces an earlier one's); verdicts are recomputed."""
    rows = [
        "| trace | nodes (GPUs) | regime | pending p95 / p99 (s), CP-SAT | nos-like greedy "
        "| p95 / p99 ratio | whole-node pods, median wait (s) | reconfigured | theft | disrupted "
        "| wall s | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for head, (c, g) in _rows_with(paths, "cpsat", "greedy"):
        v = verdict(c, g)
        failed = [k for k, ok in v["checks"].items() if not ok]
        rows.append(
            f"{head}| {v['regime'].split(' (')[0]} "
            f"| {c['pending_p95_s']:,.0f} / {c['pending_p99_s']:,.0f} "
            f"| {g['pending_p95_s']:,.0f} / {g['pending_p99_s']:,.0f} "
            f"| {v['p95_ratio'] if v['p95_ratio'] is not None else '-'} / "
            f"{v['p99_ratio'] if v['p99_ratio'] is not None else '-'} "
            f"| {_whole(c)} vs {_whole(g)} "
            f"| {c['gpus_reconfigured']} vs {g['gpus_reconfigured']} "
            f"| {c.get('theft', 0)} vs {g.get('theft', 0)} "
            f"| {c['pods_disrupted']} vs {g['pods_disrupted']} "
            f"| {_secs(c.get('wall_s'))} / {_secs(g.get('wall_s'))} "
            f"| {'pass' if v['pass'] else 'FAIL: ' + ', '.join(failed)} |"
        )
    return "\n".join(rows)


def _secs(value: Any) -> str:
    return "-" if value is None else f"{float(value):,.0f}"


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _write_report(args: argparse.Namespace, trace: str, nodes: int, opts: dict[str, Any]) -> None:
    from simulations.reports.replay_report import write_replay_report

    workload, _ = _load(trace, opts["openb_dir"], opts["times_from"], opts["seed"])
    settings = _settings(opts)
    cluster = _cluster_of(nodes, opts)
    pods = _pods_for(workload, cluster, settings)
    results = []
    for name in _split(args.policies):
        if name == "static":
            continue
        pol = parse_policy(name)
        if pol.planner_policy is Policy.CPSAT:
            pol = replace(pol, window=None)
        results.append(run_time_replay(workload, cluster, pol, settings, pods=pods))
    write_replay_report(
        results,
        args.report,
        title=f"Time replay: openb {trace} on {cluster.summary()}",
        context={**opts["settings"], "cluster GPUs": cluster.total_gpus},
    )


def _best_static(
    candidates: Sequence[StaticPolicy],
    workload: Workload,
    cluster: Cluster,
    settings: ReplaySettings,
    pods: Sequence[ReplayPod],
) -> tuple[StaticPolicy, ReplayResult, dict[str, tuple[str, ReplayResult]]]:
    """Replay every static candidate; the best by (never scheduled, p95, p50) and all runs."""
    runs: dict[str, tuple[str, ReplayResult]] = {}

    def evaluate(sp: StaticPolicy) -> tuple[float, ...]:
        policy = ReplayPolicy(f"static:{sp.name}", static=sp)
        r = run_time_replay(workload, cluster, policy, settings, pods=pods)
        runs[sp.name] = (sp.describe(), r)
        return _static_key(r)

    best, _key, _all = best_static(candidates, evaluate)
    chosen = runs[best.name][1]
    chosen.policy = f"best-static ({best.name})"
    return best, chosen, runs


def _pick(d: dict[str, Any]) -> dict[str, Any]:
    keys = ("pending_p50_s", "pending_p95_s", "pending_p99_s", "never_scheduled", "allocation_mean")
    return {k: d[k] for k in keys}


if __name__ == "__main__":
    sys.exit(main())
