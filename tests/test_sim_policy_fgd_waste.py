"""The what-if GPU-share rule ``fgd-waste`` (simulations.saturation.policies.fgd_waste): measure and score on hand-computed
cases, node and GPU choice, determinism, and a smoke run of the saturation protocol."""

from __future__ import annotations

import random

import numpy as np
import pytest

from simulations.inputs.cluster import Cluster, Node
from simulations.inputs.workload import Pod, Workload
from simulations.saturation.fragmentation import FragModel, TargetWorkload
from simulations.saturation.policies import FgdWaste
from simulations.saturation.policies.fgd_waste import CpuAwareFragModel, FgdWasteMeasure, step_score
from simulations.saturation.policies.state import ShareState
from simulations.saturation.protocol import run_saturation

# target: 810 milli (p 0.6, 3000 CPU), 1000 milli (p 0.4, 8000 CPU)
ORIGINALS = [Pod(f"a{i}", 3000, 0, 1, 810) for i in range(3)] + [
    Pod(f"b{i}", 8000, 0, 1, 1000) for i in range(2)
]
T_810 = TargetWorkload.from_pods(ORIGINALS, coverage=1.0)


def measure_value(frees: tuple[int, ...], cpu: int = 96000) -> float:
    m = FgdWasteMeasure(T_810)
    return m.frag(m.model_class("G2"), cpu, frees)


def test_step_score_is_minus_floor_of_twenty_milli_steps() -> None:
    assert step_score(0.0) == 0 and step_score(19.9) == 0 and step_score(20.0) == -1
    assert step_score(-0.1) == 1 and step_score(-40.0) == 2 and step_score(228.0) == -11


def test_measure_hand_computed() -> None:
    # two free GPUs: F' = 0 (both shapes fit both); W = 2 x w(1000) = 2 x (0.6 x 190) = 228
    assert measure_value((1000, 1000)) == pytest.approx(0.5 * 228)
    # an 810 on one: F' = 0.6 x 190 + 0.4 x 190 = 190; W = 190 + 114 -> G = 190 + 152
    assert measure_value((190, 1000), cpu=93000) == pytest.approx(342.0)
    # one GPU with 840 free: F' = 0.4 x 840 (1000 does not fit); W = w(840) = w(30) = 30
    assert measure_value((840,)) == pytest.approx(336 + 0.5 * 30)
    # no CPU for any shape: F' = idle, W = idle
    assert measure_value((1000, 300), cpu=1000) == pytest.approx(1300 + 0.5 * 1300)


def test_measure_adds_half_the_waste_to_the_cpu_aware_fragmentation() -> None:
    t = TargetWorkload.from_pods(
        [*ORIGINALS, Pod("c", 12000, 0, 0, 0), Pod("d", 30000, 0, 2, 1000)], coverage=1.0
    )
    g, f = FgdWasteMeasure(t), CpuAwareFragModel(t)
    for cpu, frees in [(96000, (0, 190, 500, 1000)), (20000, (1000, 1000, 1000)), (5000, (60,))]:
        cls = g.model_class("T4")
        access = [True] * len(t.shapes)
        expected = f.frag(f.model_class("T4"), cpu, frees) + 0.5 * g.waste.node_waste(
            access, cpu, frees
        )
        assert g.frag(cls, cpu, frees) == pytest.approx(expected)


def test_measure_rejects_a_bad_weight() -> None:
    with pytest.raises(ValueError, match="waste_weight"):
        FgdWasteMeasure(T_810, waste_weight=-1.0)


def two_node_state(second_node_used: int) -> ShareState:
    """Node A (rank 0): 2 free GPUs; node B (rank 1): 1 GPU with ``second_node_used`` taken."""
    cluster = Cluster(
        "tiny",
        (Node("a", 96000, 10**6, 2, "G2"), Node("b", 96000, 10**6, 1, "G2")),
    )
    state = ShareState(cluster, [0, 1], FragModel(T_810))
    if second_node_used:
        state.place(1, Pod("small", 1000, 0, 1, second_node_used), (0,))
    return state


def test_810_goes_onto_the_gpu_it_completes_not_the_lowest_rank() -> None:
    state = two_node_state(160)
    policy = FgdWaste()
    policy.prepare(state, ORIGINALS)
    pod = Pod("x", 3000, 0, 1, 810)
    # A: ΔG = 342 - 114 = 228 -> score -11; B: 840 -> 30 free: ΔG = (30 + 15) - 351 -> score 16
    assert policy.choose(state, pod, state.feasible(pod)) == (1, (0,))


def test_ties_go_to_the_smallest_rank_and_negative_scores_work() -> None:
    state = two_node_state(0)  # A: 2 free GPUs, B: 1 free GPU
    policy = FgdWaste()
    policy.prepare(state, ORIGINALS)
    pod = Pod("x", 3000, 0, 1, 810)
    # B: ΔG = (190 + 95) - 57 = 228, like A: both score -11, A has the smaller rank
    assert policy.choose(state, pod, state.feasible(pod)) == (0, (0,))
    only_b = np.array([1])
    assert policy.choose(state, pod, only_b) == (1, (0,))


def small_run(seed: int, batch: int) -> tuple[Cluster, Workload]:
    rng = random.Random(seed)
    kinds = [(96000, 8, "G2"), (104000, 2, "T4"), (32000, 4, "V100M16"), (16000, 2, "P100")]
    nodes = []
    for i in range(12):
        cpu, gpus, model = rng.choice(kinds)
        nodes.append(Node(f"n{i:02d}", cpu, cpu * 4, gpus, model))
    shapes = [
        (3152, 1, 810),
        (11300, 1, 1000),
        (8000, 1, 470),
        (4000, 1, 320),
        (2000, 1, 160),
        (12500, 0, 0),
        (48000, 4, 1000),
        (6000, 1, 650),
    ]
    pods = []
    for i in range(40):
        cpu, ng, gm = rng.choice(shapes)
        spec = rng.choice([(), (), ("T4",), ("G2", "P100")]) if ng else ()
        pods.append(Pod(f"p{i:03d}", cpu, 1024, ng, gm, gpu_spec=spec))
    return Cluster("small", tuple(nodes)), Workload("small", tuple(pods))


@pytest.mark.parametrize("batch", [1, 4])
def test_saturation_smoke_and_determinism(batch: int) -> None:
    cluster, wl = small_run(3, batch)
    a = run_saturation(cluster, wl, "fgd-waste", 11, batch=batch)
    b = run_saturation(cluster, wl, FgdWaste(), 11, batch=batch)
    assert a.policy == "fgd-waste" and a.placed + a.failed == a.pods
    assert np.array_equal(a.used, b.used) and np.array_equal(a.frag, b.frag)
    assert 0 < a.used[-1] <= cluster.total_gpus * 1000
    assert a.arrived[-1] > cluster.total_gpus * 1000  # saturated: demand beyond capacity
    assert a.failed > 0
