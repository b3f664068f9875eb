"""FGD's target workload, fragmentation measure, score and metrics on hand-computed cases,
plus the paper's test vectors (fgd.md §5) on the openb default trace."""

from __future__ import annotations

import pytest
from openb_data import OPENB, needs_openb

from simulations.inputs.openb import load_openb_pods
from simulations.inputs.workload import Pod
from simulations.saturation.fragmentation import (
    FragModel,
    TargetWorkload,
    frag_amount_pct,
    frag_ratio_pct,
)
from simulations.saturation.policies.baselines import fgd_score
from simulations.saturation.policies.fgd_waste import CpuAwareFragModel


def pods(*specs: tuple[int, int, int, int]) -> list[Pod]:
    """(count, cpu, num_gpu, gpu_milli) -> that many pods."""
    out: list[Pod] = []
    for count, cpu, ng, gm in specs:
        out += [Pod(f"p{len(out) + i}", cpu, 0, ng, gm) for i in range(count)]
    return out


def small_target() -> TargetWorkload:
    # A: 2 x (1000 cpu, 1 x 500)   B: 1 x (2000 cpu, 1 x 1000)   C: 1 x CPU-only 500
    return TargetWorkload.from_pods(pods((2, 1000, 1, 500), (1, 2000, 1, 1000), (1, 500, 0, 0)))


def test_target_order_probabilities_and_inclusive_cut() -> None:
    t = small_target()
    # count descending, ties by key descending (cpu 2000 before 500)
    assert [(s.cpu_milli, s.gpu_milli, s.num_gpu, s.p) for s in t.shapes] == [
        (1000, 500, 1, 0.5),
        (2000, 1000, 1, 0.25),
        (500, 0, 0, 0.25),
    ]
    # 10 + 9 of 20 pods = exactly 95 %: the cut is inclusive, the 1-pod shape is left out
    cut = TargetWorkload.from_pods(pods((10, 1, 1, 100), (9, 2, 1, 200), (1, 3, 1, 300)))
    assert [(s.gpu_milli, round(s.p, 6)) for s in cut.shapes] == [
        (100, round(10 / 19, 6)),
        (200, round(9 / 19, 6)),
    ]
    assert cut.distinct_shapes == 3 and cut.coverage == 0.95


def test_node_fragmentation_hand_computed() -> None:
    m = FragModel(small_target())
    cls = m.model_class("X")
    # frees (300, 1000), idle 1300, cpu 1500:
    #   A fits (cpu 1000, one GPU >= 500): frag = 300            -> 0.5  * 300
    #   B lacks CPU (2000 > 1500):         frag = idle = 1300    -> 0.25 * 1300
    #   C CPU-only:                        frag = idle           -> 0.25 * 1300
    assert m.frag(cls, 1500, (300, 1000)) == pytest.approx(150 + 325 + 325)
    # with 2500 cpu B fits too: frag_B = 300 (the GPU below 1000)
    assert m.frag(cls, 2500, (300, 1000)) == pytest.approx(150 + 75 + 325)
    # a full node: A and B lack GPU, everything is idle (0) -> 0
    assert m.frag(cls, 2500, (0, 0)) == 0.0
    # no GPUs: 0
    assert m.frag(cls, 2500, ()) == 0.0


def test_spec_excluding_the_model_counts_all_idle() -> None:
    t = TargetWorkload.from_pods([Pod("a", 100, 0, 1, 500, gpu_spec=("T4",))])
    m = FragModel(t)
    assert m.frag(m.model_class("T4"), 1000, (1000,)) == 0.0
    assert m.frag(m.model_class("P100"), 1000, (1000,)) == 1000.0
    assert m.model_class("T4") != m.model_class("P100")
    assert m.model_class("P100") == m.model_class("V100M16")  # same access: shared memo class


def test_cpu_aware_measure_counts_gpus_cpu_cannot_feed() -> None:
    t = TargetWorkload.from_pods([Pod("a", 1000, 0, 1, 500)])
    fgd, ours = FragModel(t), CpuAwareFragModel(t)
    c1, c2 = fgd.model_class("X"), ours.model_class("X")
    # CPU for 2 pods, 2 fitting GPUs: both measures say 0
    assert fgd.frag(c1, 2000, (1000, 1000)) == ours.frag(c2, 2000, (1000, 1000)) == 0.0
    # CPU for 1 pod: FGD still counts both GPUs usable; the CPU-aware measure only the fuller one
    assert fgd.frag(c1, 1500, (800, 1000)) == 0.0
    assert ours.frag(c2, 1500, (800, 1000)) == 800.0
    # no CPU at all: both count everything
    assert fgd.frag(c1, 500, (800, 1000)) == ours.frag(c2, 500, (800, 1000)) == 1800.0


def test_score_and_cluster_metrics() -> None:
    assert fgd_score(0.0) == 50
    assert fgd_score(3000.0) == 4  # fgd.md §5
    assert fgd_score(-40.0) == 50 and fgd_score(-41.0) == 51  # ~40 milli per point near 0
    assert fgd_score(1e6) == 0
    assert frag_amount_pct(6212 * 1000 * 0.05, 6212) == pytest.approx(5.0)
    assert frag_ratio_pct(50.0, 200.0) == 25.0 and frag_ratio_pct(10.0, 0.0) == 0.0


@needs_openb
def test_fgd_paper_vectors_on_default_trace() -> None:
    t = TargetWorkload.from_pods(load_openb_pods(OPENB / "openb_pod_list_default.csv").pods)
    assert (t.distinct_shapes, len(t.shapes)) == (91, 35)
    assert t.coverage == pytest.approx(0.9526, abs=5e-5)
    first, second = t.shapes[:2]
    assert (first.cpu_milli, first.gpu_milli, first.num_gpu, round(first.p, 4)) == (
        3152,
        810,
        1,
        0.1348,
    )
    assert (second.cpu_milli, second.gpu_milli, second.num_gpu, round(second.p, 4)) == (
        11300,
        1000,
        1,
        0.1125,
    )
    cpu_only = [s for s in t.shapes if s.is_cpu_only]
    assert sorted(s.cpu_milli for s in cpu_only) == [8000, 12500, 15400, 16500, 32000]
    assert sum(s.p for s in cpu_only) == pytest.approx(0.13598, abs=5e-6)

    m = FragModel(t)
    cls = m.model_class("G2")
    empty = m.frag(cls, 96000, (1000,) * 8)
    assert round(empty, 2) == 1087.82
    after_share = m.frag(cls, 96000 - 3152, (190,) + (1000,) * 7)
    assert round(after_share, 2) == 1140.52 and fgd_score(after_share - empty) == 48
    after_whole = m.frag(cls, 96000 - 11300, (0,) + (1000,) * 7)
    assert round(after_whole, 2) == 951.84 and fgd_score(after_whole - empty) == 53
