"""Who places the partitioner protocol's CPU-only pods (simulations.saturation.partitioned
CpuScheduler) and kube-scheduler's scoring they use (simulations.replay.kube_score): scores by
hand from facts/k8s-scheduling.md section 5, the adaptive node sample and its rotating start,
each scheduler's choice on hand-built states, and the CLI's refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.settings import PlannerSettings
from planner.snapshot import Mode, MpsSlice
from simulations.bench_saturation import main as bench_main
from simulations.inputs.cluster import Cluster, Node
from simulations.inputs.workload import Pod, Workload
from simulations.replay.kube_score import Strategy, nodes_to_score, resource_score
from simulations.saturation.partitioned import CpuScheduler, PartitionedState, partitioned_cluster
from simulations.saturation.runner import cpu_scheduler_of, run_policy


def test_scores_by_hand() -> None:
    # 32 cores / 128 GiB, 8 cores and 32 GiB bound, a pod of 8 cores and 32 GiB
    mib = 128 * 1024
    least = resource_score(32000, mib, 8000, mib // 4, 8000, mib // 4)
    # LeastAllocated: (32-16)/32 = 50 for both; balanced: equal fractions, std 0 -> 100
    assert least == 50 + 100
    most = resource_score(32000, mib, 8000, mib // 4, 8000, mib // 4, Strategy.MOST_ALLOCATED)
    assert most == 50 + 100
    # unbalanced: CPU half used after the pod, memory none -> fractions 0.5 and 0.0, std 0.25
    unbal = resource_score(32000, mib, 8000, 0, 8000, 0, Strategy.LEAST_ALLOCATED)
    # memory counts the 200 MiB default request for the fit score: (131072-200)/131072 =
    # 99.85 %, rounded down to 99 as kube-scheduler's integer arithmetic does; the mean of 50
    # and 99 rounded down: 74 (rounding to nearest gave 75, and some node pairs the other
    # way round)
    assert unbal == 74 + 75
    # the balance score is truncated: fractions 0.25 and 0 -> std 0.125 -> 87.5 -> 87
    assert resource_score(1000, 1000, 0, 0, 250, 0) == (75 + 80) // 2 + 87
    # over capacity scores 0 (Least) and caps at 100 (Most)
    assert resource_score(1000, 1000, 900, 0, 500, 0) == round((0 + 80) / 2) + round(
        (1 - 0.5) * 100
    )
    assert resource_score(1000, 1000, 900, 0, 500, 0, Strategy.MOST_ALLOCATED) == round(
        (100 + 20) / 2
    ) + round((1 - 0.5) * 100)
    # a resource with no allocatable is skipped by the balance (std over one fraction: 0)
    assert resource_score(1000, 0, 0, 0, 500, 0) == round(50 / 2) + 100


@pytest.mark.parametrize(
    ("nodes", "scored"),
    [(1, 1), (99, 99), (100, 100), (1213, 1213 * 41 // 100), (5000, 500), (20000, 1000)],
)
def test_nodes_to_score_is_the_adaptive_share(nodes: int, scored: int) -> None:
    assert nodes_to_score(nodes) == scored


def _state(cpus: list[int], scheduler: CpuScheduler, gpus: int = 1) -> PartitionedState:
    c = Cluster(
        "t", tuple(Node(f"n{i:03d}", cpu, 1 << 20, gpus, model="G2") for i, cpu in enumerate(cpus))
    )
    part = partitioned_cluster(c, Mode.MPS)
    return PartitionedState(part, list(range(len(part.nodes))), PlannerSettings(), scheduler)


def test_least_allocated_spreads_most_allocated_packs() -> None:
    pod = Pod("c", 4000, 1024, 0, 0)
    for scheduler, want in (
        (CpuScheduler.LEAST_ALLOCATED, "n001"),
        (CpuScheduler.MOST_ALLOCATED, "n000"),
    ):
        st = _state([64000, 64000, 64000], scheduler)
        st.nodes[0].cpu_free -= 32000  # n000 half used
        st.nodes[2].cpu_free -= 62000  # n002 has too little CPU left for the pod
        went = st.place_cpu_only(pod)
        assert went is not None and went.name == want
        assert went.cpu_free == {"n000": 32000 - 4000, "n001": 60000}[want]


def test_bestfit_sees_the_free_gpus_kube_scheduler_does_not() -> None:
    # two nodes with the same CPU; n000's GPU is taken: FGD's BestFit prefers it (less free
    # GPU), kube-scheduler's profiles score CPU and memory only and tie (ties: the first node
    # found, here n001, where the last cycle stopped; no fixed rank)
    pod = Pod("c", 4000, 1024, 0, 0)
    chosen = {}
    for scheduler in CpuScheduler:
        st = _state([64000, 64000], scheduler)
        st._next_start = 1
        st.nodes[0].gpus[0].mps.append(MpsSlice(79 * 1024, True, 100))
        st.refresh(st.nodes[0])
        went = st.place_cpu_only(pod)
        assert went is not None
        chosen[scheduler] = went.name
    assert chosen[CpuScheduler.BESTFIT] == "n000"
    assert chosen[CpuScheduler.LEAST_ALLOCATED] == "n001"
    assert chosen[CpuScheduler.MOST_ALLOCATED] == "n001"


def test_the_sample_starts_where_the_last_cycle_stopped() -> None:
    # 200 nodes: 100 feasible ones are collected per cycle; MostAllocated takes the fullest
    # of those seen, so a fuller node outside the first window is chosen only once the start
    # has moved past the window
    st = _state([64000] * 200, CpuScheduler.MOST_ALLOCATED)
    st.nodes[150].cpu_free = 10000  # the fullest node, outside the first 100, its memory
    st.nodes[150].mem_free = (1 << 20) * 10 // 64  # as full (balanced: no penalty)
    pod = Pod("c", 1000, 0, 0, 0)
    first = st.place_cpu_only(pod)
    assert first is not None and first.name != "n150"
    second = st.place_cpu_only(pod)
    assert second is not None and second.name == "n150"
    none = _state([500] * 3, CpuScheduler.LEAST_ALLOCATED).place_cpu_only(pod)
    assert none is None


def test_unknown_scheduler_and_the_papers_rows_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(ValueError, match="choose one of bestfit, least-allocated"):
        cpu_scheduler_of("spread")
    c = Cluster("t", (Node("n0", 64000, 1 << 20, 1, model="G2"),))
    wl = Workload("w", (Pod("a", 1000, 0, 1, 500),))
    with pytest.raises(ValueError, match="partitioner protocol's rows only"):
        run_policy(c, wl, "fgd", 1, cpu_scheduler="least-allocated")
    assert bench_main(["--policies", "fgd,gpuslice", "--cpu-scheduler", "most-allocated"]) == 2
    assert "rows fgd place every pod" in capsys.readouterr().err
    assert bench_main(["--policies", "gpuslice", "--cpu-scheduler", "nope"]) == 2
    assert "unknown CPU scheduler 'nope'" in capsys.readouterr().err


def test_host_lists_hold_the_nodes_the_planners_polish_scores_best() -> None:
    """The protocol's snapshot must hold what production's polish, which sees every node,
    would choose: a node whose CPU strands its free GPUs is last by best fit, first by the
    polish's measure (planner.mps_polish.node_score)."""
    from simulations.inputs.mapping import make_mapping
    from simulations.saturation.partitioned import _hosts, _polish_measure

    st = _state([64000] * 12 + [2000], CpuScheduler.LEAST_ALLOCATED, gpus=8)
    for n in st.nodes[:12]:
        for g in n.gpus:
            g.mps.append(MpsSlice(60 * 1024, True, 75))
        st.refresh(n)
    settings = PlannerSettings(free_capacity_mps_shapes=((8000, 10 * 1024, 1, 1.0),))
    ranker = _polish_measure(settings, st.usable_mib)
    assert ranker is not None
    pod = Pod("p", 2000, 0, 1, 130)  # 130 milli -> a 10 GiB slice
    req = make_mapping("mps-memory", st.model, settings.mps_reserve_mib).map(pod)
    assert req is not None and req.memory_gb == 10
    hosts = _hosts(st.nodes, pod, req, 96, ranker)
    assert hosts[0].name == "n012"  # the stranded node first
    assert [n.name for n in hosts[1:]] == [f"n{i:03d}" for i in range(12)]  # then best fit
    best_fit_only = _hosts(st.nodes, pod, req, 96, None)
    assert "n012" not in [n.name for n in best_fit_only[:12]]
    assert _polish_measure(replace(settings, mps_polish=False), st.usable_mib) is None


def test_a_multi_gpu_pods_host_list_holds_the_node_the_polish_scores_best() -> None:
    """The same for a pod on two whole GPUs: twelve nodes of two free GPUs fill best fit's
    96 GPUs; ``n012``, eight free GPUs whose CPU admits two one-GPU pods of the target and no
    eight-GPU one, is where the two GPUs cost the target least (planner.mps_polish.node_score
    with count 2), so it heads the list."""
    from simulations.inputs.mapping import make_mapping
    from simulations.saturation.partitioned import _hosts, _polish_measure

    st = _state([64000] * 12 + [16000], CpuScheduler.LEAST_ALLOCATED, gpus=8)
    for n in st.nodes[:12]:
        for g in n.gpus[:6]:
            g.mps.append(MpsSlice(79 * 1024, True, 100))
        st.refresh(n)
    settings = PlannerSettings(
        free_capacity_mps_shapes=((64000, 79 * 1024, 8, 1.0), (8000, 79 * 1024, 1, 3.0))
    )
    ranker = _polish_measure(settings, st.usable_mib)
    assert ranker is not None
    pod = Pod("p", 8000, 0, 2, 1000)
    req = make_mapping("mps-memory", st.model, settings.mps_reserve_mib).map(pod)
    assert req is not None and req.count == 2 and req.memory_gb == 79
    hosts = _hosts(st.nodes, pod, req, 96, ranker)
    assert hosts[0].name == "n012"
    # best fit puts it last, beyond the 96 GPUs the neighbourhood takes
    assert [n.name for n in _hosts(st.nodes, pod, req, 96, None)][-1] == "n012"
