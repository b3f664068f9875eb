"""Expected waste of free GPU shares (simulations.saturation.policies.expected_waste) on hand-computed cases."""

from __future__ import annotations

import pytest

from simulations.inputs.workload import Pod
from simulations.saturation.fragmentation import TargetWorkload
from simulations.saturation.policies.expected_waste import ExpectedWaste


def target(*shapes: tuple[int, int, int, int, tuple[str, ...]]) -> TargetWorkload:
    """Shapes (count, cpu_milli, num_gpu, gpu_milli, spec) -> a target keeping all of them."""
    pods = [
        Pod(f"p{i}-{j}", cpu, 0, ng, gm, gpu_spec=spec)
        for i, (count, cpu, ng, gm, spec) in enumerate(shapes)
        for j in range(count)
    ]
    return TargetWorkload.from_pods(pods, coverage=1.0)


def all_access(t: TargetWorkload) -> list[bool]:
    return [True] * len(t.shapes)


# 810 milli (p 0.6, 3000 CPU) and 1000 milli (p 0.4, 8000 CPU)
T_810 = target((3, 3000, 1, 810, ()), (2, 8000, 1, 1000, ()))


def test_hole_values_hand_computed() -> None:
    ew = ExpectedWaste(T_810)
    s = ew.admitted(all_access(T_810), 96000)
    assert sorted(s) == [(810, 0.6), (1000, 0.4)]
    assert ew.hole(s, 1000) == pytest.approx(0.6 * 190 + 0.4 * 0)  # 114
    assert ew.hole(s, 900) == pytest.approx(90.0)  # only 810 fits, leaves 90, which nothing fits
    assert ew.hole(s, 500) == 500.0 and ew.hole(s, 0) == 0.0


def test_recursive_fill_hand_computed() -> None:
    t = target((1, 1000, 1, 500, ()), (1, 1000, 1, 300, ()))  # p 0.5 each
    ew = ExpectedWaste(t)
    s = ew.admitted(all_access(t), 4000)
    # w(400) = w(100) = 100; w(500) = .5 w(0) + .5 w(200) = 100; w(700) = .5 w(200) + .5 w(400)
    assert ew.hole(s, 400) == pytest.approx(100.0)
    assert ew.hole(s, 500) == pytest.approx(100.0)
    assert ew.hole(s, 700) == pytest.approx(150.0)
    assert ew.hole(s, 1000) == pytest.approx(0.5 * 100 + 0.5 * 150)


def test_cpu_admits_only_shapes_whose_cpu_fits() -> None:
    ew = ExpectedWaste(T_810)
    acc = all_access(T_810)
    assert ew.admitted(acc, 4000) == ((810, 0.6),)
    assert ew.hole(ew.admitted(acc, 4000), 1000) == pytest.approx(190.0)  # only 810 can come
    assert ew.admitted(acc, 2999) == ()
    assert ew.hole((), 730) == 730.0  # nothing can come: the whole share is waste


def test_spec_access_excludes_shapes() -> None:
    t = target((3, 1000, 1, 810, ("T4",)), (2, 1000, 1, 1000, ()))
    ew = ExpectedWaste(t)
    on_g2 = [s.allows_model("G2") for s in t.shapes]
    on_t4 = [s.allows_model("T4") for s in t.shapes]
    assert ew.admitted(on_g2, 96000) == ((1000, 0.4),)
    assert ew.hole(ew.admitted(on_g2, 96000), 1000) == 0.0
    assert ew.hole(ew.admitted(on_t4, 96000), 1000) == pytest.approx(0.6 * 190)


def test_node_waste_sums_the_gpus() -> None:
    ew = ExpectedWaste(T_810)
    acc = all_access(T_810)
    assert ew.node_waste(acc, 96000, (1000, 500, 0)) == pytest.approx(114 + 500 + 0)
    assert ew.node_waste(acc, 96000, ()) == 0.0


def test_multi_gpu_and_cpu_only_shapes_do_not_fill_holes() -> None:
    t = target((1, 1000, 1, 500, ()), (5, 2000, 0, 0, ()), (5, 8000, 2, 1000, ()))
    ew = ExpectedWaste(t)
    ((gm, p),) = ew.admitted(all_access(t), 96000)
    assert gm == 500 and p == pytest.approx(1 / 11)
    assert ew.hole(ew.admitted(all_access(t), 96000), 1000) == 0.0  # two 500s, renormalised


def test_bad_input_is_named() -> None:
    ew = ExpectedWaste(T_810)
    with pytest.raises(ValueError, match="one flag per shape"):
        ew.admitted([True], 1000)
    with pytest.raises(ValueError, match="free milli"):
        ew.hole((), 1001)
