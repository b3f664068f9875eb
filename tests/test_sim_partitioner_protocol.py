"""The partitioner protocol of the GPU-share saturation table (simulations.saturation.mps_rules,
simulations.saturation.mps_frag, simulations.saturation.runner): the milli view by hand, the
fragmentation tracker against a recomputation, the rules' decisions on hand-built states,
the invariants of every rule's run, and the ``gpuslice`` row calling :func:`planner.plan` on
every arrival batch."""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_sim_policy_fgd_waste import small_run

import planner.api
from planner.snapshot import Mode, MpsSlice
from simulations.bench_saturation import aggregate
from simulations.bench_saturation import main as bench_main
from simulations.inputs.cluster import Cluster, Node
from simulations.inputs.workload import Pod, Workload
from simulations.saturation.fragmentation import FragModel, TargetWorkload
from simulations.saturation.mps_frag import MpsFragTracker, full_slice_mib, milli_of
from simulations.saturation.mps_rules import RULES, run_rule
from simulations.saturation.partitioned import PartitionedState, partitioned_cluster, run_planned
from simulations.saturation.protocol import build_arrivals
from simulations.saturation.runner import GPUSLICE, ROWS, protocol_of, run_policy

USABLE = 80 * 1024 - 512  # an A100-80GB's MPS memory after the 512 MiB server reserve
FULL = 79 * 1024  # the whole-GPU slice of the mps-memory mapping


def cluster(*gpus: int, cpu: int = 64000) -> Cluster:
    return Cluster(
        "t", tuple(Node(f"n{i}", cpu, 1 << 20, g, model="G2") for i, g in enumerate(gpus))
    )


def state(c: Cluster) -> PartitionedState:
    from planner.settings import PlannerSettings

    part = partitioned_cluster(c, Mode.MPS)
    return PartitionedState(part, list(range(len(part.nodes))), PlannerSettings())


def put(st: PartitionedState, node: int, gpu: int, gib: int) -> None:
    n = st.nodes[node]
    n.gpus[gpu].mps.append(MpsSlice(gib * 1024, True, 50))
    st.refresh(n)


# target: 810 milli (p 0.6), whole GPUs (p 0.4)
ORIGINALS = [Pod(f"a{i}", 3000, 0, 1, 810) for i in range(3)] + [
    Pod(f"b{i}", 8000, 0, 1, 1000) for i in range(2)
]


def test_the_milli_view_by_hand() -> None:
    assert full_slice_mib(USABLE) == FULL
    assert milli_of(USABLE, FULL) == 1000  # an empty GPU; the reserve's spare half GiB is cut
    assert milli_of(USABLE - 63 * 1024, FULL) == 208  # beside an 810-milli pod's 63 GiB slice
    assert milli_of(15 * 1024, FULL) == 189
    assert milli_of(0, FULL) == 0 and milli_of(-5, FULL) == 0 and milli_of(100, 0) == 0


def test_tracker_equals_fgd_on_the_view_and_follows_changes() -> None:
    st = state(cluster(2, 1, 4))
    target = TargetWorkload.from_pods(ORIGINALS, coverage=1.0)
    tr = MpsFragTracker(st, target)
    model = FragModel(target)

    def recompute() -> tuple[float, int]:
        total, idle = 0.0, 0
        for n in st.nodes:
            frees = tuple(sorted(milli_of(f, FULL) for f in n.free_mib))
            total += model.frag(model.model_class(n.label), n.cpu_free, frees)
            idle += sum(frees)
        return total, idle

    assert (tr.total, tr.idle) == (0.0, 7000)  # empty GPUs: every shape fits, nothing lost
    rng = random.Random(5)
    for _ in range(12):
        k = rng.randrange(len(st.nodes))
        n = st.nodes[k]
        g = rng.randrange(len(n.gpus))
        if n.free_mib[g] >= 9 * 1024:
            put(st, k, g, rng.choice((8, 15, 37, 63)))
        n.cpu_free -= rng.choice((0, 1000, 30000))
        tr.update((n,))
        total, idle = recompute()
        assert tr.total == pytest.approx(total) and tr.idle == idle
    assert tr.total > 0


def test_fgd_fills_the_gpu_it_completes_and_bestfit_the_tighter_node() -> None:
    # n0 GPU0 holds 16 GiB (63.5 GiB free: an 810-milli pod's 63 GiB slice just fits);
    # n1 is empty.  FGD: n0's free 803 milli can serve neither target shape, so filling it
    # lowers F (delta -797, score 68); on n1 the pod leaves 208 milli no shape fits (+208,
    # score 44).  BestFit: n0 has less left over.  Both pick n0 GPU0.
    st = state(cluster(1, 1))
    put(st, 0, 0, 16)
    target = TargetWorkload.from_pods(ORIGINALS, coverage=1.0)
    tr = MpsFragTracker(st, target)
    pod = Pod("x", 3000, 0, 1, 810)
    fgd = RULES["fgd"](st, tr, target)
    assert fgd.choose(st.nodes[0], pod, 63 * 1024) == (68, (0,))
    assert fgd.choose(st.nodes[1], pod, 63 * 1024) == (44, (0,))
    bf = RULES["bestfit"](st, tr, target)
    assert bf.choose(st.nodes[0], pod, 63 * 1024)[0] > bf.choose(st.nodes[1], pod, 63 * 1024)[0]


def test_bestfit_takes_the_fullest_gpu_that_holds_the_slice() -> None:
    st = state(cluster(3))
    put(st, 0, 0, 70)  # 9.5 GiB free: too small for 10 GiB
    put(st, 0, 1, 60)  # 19.5 GiB free: the tightest that fits
    target = TargetWorkload.from_pods(ORIGINALS, coverage=1.0)
    bf = RULES["bestfit"](st, MpsFragTracker(st, target), target)
    assert bf.choose(st.nodes[0], Pod("y", 1000, 0, 1, 130), 10 * 1024)[1] == (1,)
    # a whole-GPU pod takes the lowest-indexed empty GPU
    assert bf.choose(st.nodes[0], Pod("z", 1000, 0, 1, 1000), FULL)[1] == (2,)


def small_workload(seed: int) -> tuple[Cluster, Workload]:
    """The fgd-waste tests' small mixed cluster (models, gpu_spec, CPU-only and 4-GPU pods)."""
    return small_run(seed, 1)


@pytest.mark.parametrize("rule", sorted(RULES))
def test_every_rule_run_keeps_the_protocols_invariants(rule: str) -> None:
    c, wl = small_workload(3)
    a = run_rule(c, wl, rule, 11)
    b = run_rule(c, wl, rule, 11)
    cap = c.total_gpus * 1000
    assert np.array_equal(a.used, b.used) and np.array_equal(a.frag, b.frag)  # deterministic
    assert a.policy == f"mps:{rule}" and a.placed + a.failed == a.pods == len(a.arrived)
    assert np.all(np.diff(a.used) >= 0) and a.arrived[-1] > cap  # saturated, nothing departs
    assert 0 < a.used[-1] <= cap and a.failed > 0
    assert np.all(a.frag >= 0) and a.frag[0] >= 0
    # the same arrivals and CPU-only placement as the planner's row: only GPU decisions differ
    g = run_planned(c, wl, Mode.MPS, "mps-memory", 11)
    assert np.array_equal(a.arrived, g.arrived)


def test_the_gpuslice_row_is_planner_plan_on_every_arrival_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c, wl = small_workload(4)
    calls: list[int] = []
    real = planner.api.plan

    def spy(snapshot, settings=planner.api._DEFAULT_SETTINGS, catalog=None):  # type: ignore[no-untyped-def]
        calls.append(len(snapshot.pods))
        return real(snapshot, settings, catalog)

    monkeypatch.setattr(planner.api, "plan", spy)
    for batch in (1, 4):
        calls.clear()
        r = run_policy(c, wl, GPUSLICE, 7, batch=batch)
        assert r.policy == GPUSLICE and r.extra["protocol"] == "partitioner"
        assert r.extra["planner_calls"] == len(calls) > 0
        assert max(calls) <= batch
        # every GPU pod some node could host went to the planner, in batches of its arrival
        arrivals = build_arrivals(wl.pods, c.total_gpus * 1000, random.Random(7))
        gpu_pods = sum(1 for p in arrivals if not p.is_cpu_only)
        assert sum(calls) == gpu_pods - r.extra["prefiltered_failures"]
        same = run_planned(c, wl, Mode.MPS, "mps-memory", 7, batch=batch)
        assert np.array_equal(r.used, same.used) and np.array_equal(r.frag, same.frag)


def test_rows_and_protocols() -> None:
    assert ROWS == (
        "bestfit",
        "fgd",
        "fgd-waste",
        "mps:bestfit",
        "mps:fgd",
        "mps:fgd-waste",
        "gpuslice",
    )
    assert [protocol_of(r) for r in ROWS] == ["scheduler"] * 3 + ["partitioner"] * 4
    with pytest.raises(ValueError, match="unknown policy 'mps:worstfit'; choose one of bestfit"):
        protocol_of("mps:worstfit")
    with pytest.raises(ValueError, match="unknown rule 'worstfit'; choose one of bestfit, fgd"):
        run_rule(*small_workload(1), "worstfit", 1)
    gpu_less = Cluster("cpu", (Node("c0", 8000, 1 << 20, 0, None),))
    for row in ("gpuslice", "mps:fgd"):
        with pytest.raises(ValueError, match="has no GPUs"):
            run_policy(gpu_less, small_workload(1)[1], row, 1)


def test_aggregate_reports_the_planner_time_and_protocol() -> None:
    c, wl = small_workload(2)
    rows = aggregate(
        [run_policy(c, wl, p, s) for p in ("gpuslice", "mps:fgd", "fgd") for s in (1, 2)]
    )
    assert {k: v["protocol"] for k, v in rows.items()} == {
        "gpuslice": "partitioner",
        "mps:fgd": "partitioner",
        "fgd": "scheduler",
    }
    g = rows["gpuslice"]
    assert g["planner_ms_per_call_p95"] >= g["planner_ms_per_call_p50"] > 0
    assert 0 < g["planner_ms_per_arrival"] <= g["planner_ms_per_call_p95"]
    assert "planner_ms_per_arrival" not in rows["mps:fgd"]


def test_bench_saturation_refuses_bad_jobs_and_policies(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["--jobs", "0", "--cluster", "x.yaml"]) == 2
    assert "--jobs must be >= 1" in capsys.readouterr().err
    assert bench_main(["--policies", "gpuslice,worstfit", "--cluster", "x.yaml"]) == 2
    assert "unknown policies ['worstfit']" in capsys.readouterr().err


@pytest.mark.parametrize("policy", [*sorted(f"mps:{r}" for r in RULES), GPUSLICE])
def test_no_row_places_a_multi_gpu_pod_on_mps_slices(policy: str) -> None:
    """A pod of ``num_gpu`` > 1 asks for that many MPS slices, one per GPU; the agent's
    ``Allocate`` refuses a container slices of two MPS daemons, so production never starts it
    (planner.demand.one_mps_slice) and no row of the protocol may place it; the one-GPU pods
    of the same run are placed."""
    c = cluster(2, 4)
    arrivals = [Pod("pair", 8000, 0, 2, 1000), Pod("one", 8000, 0, 1, 1000)]
    arrivals += [Pod(f"s{i}", 2000, 0, 1, 320) for i in range(3)] + [Pod("four", 8000, 0, 4, 500)]
    wl = Workload("multi", tuple(arrivals))
    if policy == GPUSLICE:
        r = run_planned(c, wl, Mode.MPS, "mps-memory", 1, arrivals=arrivals)
    else:
        r = run_rule(c, wl, policy.split(":", 1)[1], 1, arrivals=arrivals)
    assert (r.placed, r.failed) == (4, 2)
    # each counts its slice's share of the 81,408 usable MiB: a whole GPU 79 GiB (993 milli),
    # 320 milli 25 GiB (314 milli)
    assert r.used[-1] == 79 * 1024 * 1000 // 81408 + 3 * (25 * 1024 * 1000 // 81408)
