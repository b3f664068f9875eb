"""Random MIG workloads through the time replay: gpuslice vs the nos-like baseline, case by case.

The openb replays (:mod:`simulations.bench_replay`) measure three traces at three cluster
sizes.  This benchmark asks the same question of workloads nobody tuned for: each *case* is a
seeded random workload on a random small cluster, replayed under gpuslice as shipped (``cpsat``:
webhook gates, reservations, release to the planned node, deadlines, drains) and under the
nos-like greedy baseline (``greedy``: no gates, kube-scheduler binds whichever pending pod it
tries first), with the same simulated Kubernetes and the same 60 s / 10 s batch window.  Each
case is judged by issue 9's rule (:func:`simulations.bench_replay.verdict`).

Generator (:func:`random_case`, ``random.Random(case)``)
--------------------------------------------------------
* **Cluster**: 2-4 nodes of 2, 4 or 8 A100-SXM4-80GB GPUs in MIG mode, 128 CPUs and 1000 GiB
  each (CPU and memory never bind).
* **Pods**: 300 pods of a mix of 2-5 shapes.  A shape is, with probability 0.2, a multi-GPU
  pod (1, 2 or 4 whole GPUs, at most the node's GPU count; weight uniform in [0.2, 1]), else a
  one-GPU share of 100-1000 milli (weight uniform in [0.2, 3]).  Each pod asks 4 CPUs and
  8 GiB.  Shares map to the smallest MIG profile with at least ``share x 7 / 1000`` compute
  slices (``mig-compute``, as in the openb replays); whole GPUs to ``7g.80gb``.
* **Time**: exponential run times with a mean of 300, 1200 or 3600 s; Poisson arrivals at the
  rate that offers ``load`` x the cluster's GPUs in GPU shares, ``load`` one of 0.3, 0.6, 0.9
  and 1.2.  MIG rounds shares up to whole profiles, so the load the cluster sees is higher
  (a 300-milli pod holds a ``3g``: 3/7 of a GPU).

Output: one JSON document (``-o json``, the default; ``--out`` also writes it) with every case
(its parameters, both policies' summaries, the verdict) and the aggregate: cases per regime and
passing, the checks that failed and how often, the share of cases where gpuslice's p95 / p99 /
GPUs reconfigured are at most greedy's, geometric means of the p95 and p99 ratios, and the
theft and disruption totals of each policy.  ``-o table`` prints the aggregate as a table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from planner.snapshot import Mode
from simulations.bench_replay import verdict
from simulations.bench_saturation import parse_seeds
from simulations.inputs.cluster import Cluster, Node
from simulations.inputs.workload import PodShape, SyntheticSpec, Workload, synthetic_workload
from simulations.replay.engine import AgentOutage, ReplayError, ReplaySettings, run_time_replay
from simulations.replay.metrics import summarize
from simulations.reports.out_file import out_file_error

MODEL = "A100-SXM4-80GB"
SHARES = (100, 200, 300, 400, 500, 600, 800, 1000)
LOADS = (0.3, 0.6, 0.9, 1.2)
DURATIONS = (300, 1200, 3600)
POLICIES = ("cpsat", "greedy")


@dataclass(frozen=True, slots=True)
class CaseSpec:
    """One random case: the cluster, the pod mix and the offered load (module docstring)."""

    case: int
    nodes: int
    gpus_per_node: int
    mean_duration_s: int
    load: float
    mix: tuple[tuple[float, int, int], ...]
    """(weight, GPUs, milli per GPU) per shape."""
    pods: int

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def arrival_rate_per_s(self) -> float:
        total = sum(w for w, _, _ in self.mix)
        mean_gpu = sum(w * n * milli / 1000 for w, n, milli in self.mix) / total
        return self.load * self.gpus / (self.mean_duration_s * mean_gpu)


def random_case(case: int, pods: int = 300) -> CaseSpec:
    """The case's parameters, drawn from ``random.Random(case)`` (module docstring)."""
    rng = random.Random(case)
    nodes = rng.randint(2, 4)
    gpus_per_node = rng.choice((2, 4, 8))
    mix = []
    for _ in range(rng.randint(2, 5)):
        if rng.random() < 0.2:
            n = rng.choice([k for k in (1, 2, 4) if k <= gpus_per_node])
            mix.append((round(rng.uniform(0.2, 1.0), 3), n, 1000))
        else:
            mix.append((round(rng.uniform(0.2, 3.0), 3), 1, rng.choice(SHARES)))
    return CaseSpec(
        case=case,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        mean_duration_s=rng.choice(DURATIONS),
        load=rng.choice(LOADS),
        mix=tuple(mix),
        pods=pods,
    )


def build(spec: CaseSpec) -> tuple[Workload, Cluster]:
    workload = synthetic_workload(
        SyntheticSpec(
            count=spec.pods,
            mix=tuple(PodShape(w, 4000, 8192, n, milli) for w, n, milli in spec.mix),
            arrival_rate_per_s=spec.arrival_rate_per_s(),
            mean_duration_s=spec.mean_duration_s,
            seed=spec.case,
        )
    )
    nodes = tuple(
        Node(f"n{i}", 128_000, 1_024_000, spec.gpus_per_node, MODEL, Mode.MIG, MODEL)
        for i in range(spec.nodes)
    )
    return workload, Cluster(f"random-{spec.case}", nodes)


Job = (
    tuple[int, int]
    | tuple[int, int, tuple[float, float] | None]
    | tuple[int, int, tuple[float, float] | None, Mapping[str, float]]
)
"""``(case, pods[, outage[, settings]])``: one case of :func:`run_case`."""


def run_case(job: Job) -> dict[str, Any]:
    """Both policies on one case (in its own process when ``--jobs`` > 1); a third item
    ``(start, end)`` stops node ``n0``'s agent then (``--agent-outage``), a fourth overrides
    :class:`ReplaySettings` fields (``--plugin-lag``: ``plugin_lag_s``, ``--agent-lease``:
    ``agent_lease_s``, ``--recreate-stranded``: ``recreate_stranded_s``)."""
    case, pods = job[0], job[1]
    outage = job[2] if len(job) > 2 else None
    overrides = job[3] if len(job) > 3 else {}
    spec = random_case(case, pods)
    workload, cluster = build(spec)
    out: dict[str, Any] = {**asdict(spec), "gpus": spec.gpus, "policies": {}}
    base = ReplaySettings(outages=(AgentOutage("n0", *outage),) if outage is not None else ())
    settings = replace(
        base,
        plugin_lag_s=overrides.get("plugin_lag_s", base.plugin_lag_s),
        agent_lease_s=overrides.get("agent_lease_s", base.agent_lease_s),
        recreate_stranded_s=overrides.get("recreate_stranded_s", base.recreate_stranded_s),
    )
    for policy in POLICIES:
        result = run_time_replay(workload, cluster, policy, settings)
        summary = summarize(result).as_dict()
        summary["wall_s"] = round(result.wall_s, 2)
        out["policies"][policy] = summary
    out["verdict"] = verdict(out["policies"]["cpsat"], out["policies"]["greedy"])
    return out


def _geomean_ratio(pairs: Sequence[tuple[float, float]]) -> float | None:
    """Geometric mean of (a + 1) / (b + 1): the +1 s keeps zero waits comparable."""
    if not pairs:
        return None
    return round(math.exp(sum(math.log((a + 1) / (b + 1)) for a, b in pairs) / len(pairs)), 3)


def aggregate(cases: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per regime: cases and passes; failed checks; at-most-greedy shares; ratios; safety."""
    regimes: dict[str, dict[str, int]] = {}
    failed: Counter[str] = Counter()
    for c in cases:
        v = c["verdict"]
        r = regimes.setdefault(v["regime"], {"cases": 0, "pass": 0})
        r["cases"] += 1
        r["pass"] += bool(v["pass"])
        failed.update(k for k, ok in v["checks"].items() if not ok)
    pairs = [(c["policies"]["cpsat"], c["policies"]["greedy"]) for c in cases]
    n = len(pairs)

    def share(key: str) -> float | None:
        return round(sum(a[key] <= b[key] for a, b in pairs) / n, 3) if n else None

    return {
        "cases": n,
        "pass": sum(bool(c["verdict"]["pass"]) for c in cases),
        "regimes": regimes,
        "failed_checks": dict(failed.most_common()),
        "cpsat_at_most_greedy": {
            "p95": share("pending_p95_s"),
            "p99": share("pending_p99_s"),
            "gpus_reconfigured": share("gpus_reconfigured"),
        },
        "geomean_ratio_cpsat_to_greedy": {
            "p50": _geomean_ratio([(a["pending_p50_s"], b["pending_p50_s"]) for a, b in pairs]),
            "p95": _geomean_ratio([(a["pending_p95_s"], b["pending_p95_s"]) for a, b in pairs]),
            "p99": _geomean_ratio([(a["pending_p99_s"], b["pending_p99_s"]) for a, b in pairs]),
            "mean": _geomean_ratio([(a["pending_mean_s"], b["pending_mean_s"]) for a, b in pairs]),
        },
        "totals": {
            p: {
                k: sum(c["policies"][p].get(k, 0) for c in cases)
                for k in (
                    "theft",
                    "pods_disrupted",
                    "never_scheduled",
                    "gpus_reconfigured",
                    "overtakes",
                    "admission_rejections",
                )
            }
            for p in POLICIES
        },
    }


def render(doc: dict[str, Any]) -> str:
    agg = doc["aggregate"]
    lines = [
        f"random MIG replay: {agg['cases']} cases ({doc['settings']['cases']}), "
        f"{doc['settings']['pods']} pods each; issue 9's rule passes in {agg['pass']}",
        f"{'REGIME':40s} {'CASES':>5s} {'PASS':>5s}",
    ]
    for regime, r in sorted(agg["regimes"].items()):
        lines.append(f"{regime:40s} {r['cases']:5d} {r['pass']:5d}")
    lines.append(
        "failed checks: "
        + (", ".join(f"{k} {v}" for k, v in agg["failed_checks"].items()) or "none")
    )
    at_most = agg["cpsat_at_most_greedy"]
    ratio = agg["geomean_ratio_cpsat_to_greedy"]
    lines.append(
        f"gpuslice <= greedy in: p95 {at_most['p95']}, p99 {at_most['p99']}, "
        f"GPUs reconfigured {at_most['gpus_reconfigured']} of the cases; geometric mean "
        f"ratio p50 {ratio['p50']}, p95 {ratio['p95']}, p99 {ratio['p99']}, "
        f"mean {ratio['mean']}"
    )
    for p, t in agg["totals"].items():
        lines.append(f"{p}: " + ", ".join(f"{k} {v}" for k, v in t.items()))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m simulations.bench_random_replay", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--cases", default="0-199", help="case numbers: A-B or a,b,c (default 0-199)")
    ap.add_argument("--pods", type=int, default=300, help="pods per case (default 300)")
    ap.add_argument("--jobs", type=int, default=1, help="processes (default 1)")
    ap.add_argument("-o", "--output", choices=("json", "table"), default="json")
    ap.add_argument("--out", help="also write the JSON document to this file")
    ap.add_argument(
        "--agent-outage",
        metavar="START:END",
        help="stop node n0's agent from START to END simulated seconds in every case "
        "(simulations.replay.engine, 'Agent outages'): what an agent crash costs each policy",
    )
    ap.add_argument(
        "--plugin-lag",
        type=float,
        default=ReplaySettings().plugin_lag_s,
        metavar="SECONDS",
        help="the partitioner's plugin_lag_s (default %(default)g): how long a kubelet may list "
        "none of the slices an agent reports before the node counts as having lost its device "
        "plugin; a huge value turns that rule off",
    )
    ap.add_argument(
        "--agent-lease",
        type=float,
        default=ReplaySettings().agent_lease_s,
        metavar="SECONDS",
        help="the agents' heartbeat Lease duration (default %(default)g; 0: no Lease, a "
        "stopped agent is then found by the kubelet's listing and the apply deadline only)",
    )
    ap.add_argument(
        "--recreate-stranded",
        type=float,
        default=ReplaySettings().recreate_stranded_s,
        metavar="SECONDS",
        help="the partitioner's recreate_stranded_s (default %(default)g): a pod released to a "
        "node whose agent then stopped is evicted after this long and created again by its Job "
        "(0: never; it waits for the agent)",
    )
    args = ap.parse_args(argv)
    outage: tuple[float, float] | None = None
    if args.agent_outage:
        try:
            o = AgentOutage.parse(f"n0:{args.agent_outage}")
        except ReplayError:
            print(
                f"bench_random_replay: --agent-outage {args.agent_outage!r}: expected "
                "START:END in seconds with 0 <= START < END, e.g. 1000:5000",
                file=sys.stderr,
            )
            return 2
        outage = (o.start_s, o.end_s)
    try:
        cases = parse_seeds(args.cases, what="cases")
    except ValueError as e:
        print(f"bench_random_replay: --cases: {e}", file=sys.stderr)
        return 2
    if args.pods < 1 or args.jobs < 1:
        print("bench_random_replay: --pods and --jobs must be >= 1", file=sys.stderr)
        return 2
    if not args.plugin_lag >= 0 or not args.agent_lease >= 0 or not args.recreate_stranded >= 0:
        print(
            "bench_random_replay: --plugin-lag, --agent-lease and --recreate-stranded must be "
            ">= 0 seconds",
            file=sys.stderr,
        )
        return 2
    if problem := out_file_error("--out", args.out):
        print(f"bench_random_replay: {problem}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    overrides = {
        "plugin_lag_s": args.plugin_lag,
        "agent_lease_s": args.agent_lease,
        "recreate_stranded_s": args.recreate_stranded,
    }
    jobs: list[Job] = [(c, args.pods, outage, overrides) for c in cases]
    if args.jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            done = pool.map(run_case, jobs, chunksize=1)
    else:
        done = [run_case(j) for j in jobs]
    doc = {
        "benchmark": "time replay, random MIG workloads",
        "date": dt.date.today().isoformat(),
        "command": "python -m simulations.bench_random_replay "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "settings": {
            "cases": args.cases,
            "pods": args.pods,
            **asdict(ReplaySettings()),
            "outages": [["n0", *outage]] if outage is not None else [],
            **overrides,
        },
        "aggregate": aggregate(done),
        "cases": done,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    text = json.dumps(doc, indent=2, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(render(doc) if args.output == "table" else text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
